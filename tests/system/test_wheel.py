"""The package as a user installs it: a wheel built from the source tree, installed non-editable into a fresh
virtual environment, runs the default job from an unrelated directory with the configs it ships."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.conftest import ROOT

# The wheel's files stored, not deflated: the same contents, built in 2 s instead of 11 (deflating the three
# embedded models' 80 MB is what a wheel build spends its time on; how the archive compresses is not under test)
STORED = "-C--build-option=--compression=stored"
IGNORE = shutil.ignore_patterns(".git", ".venv", "outputs", "build", "dist", "*.egg-info", "__pycache__",
                                "wandb", ".hypothesis", "multirun", "*.so", "_native.json")  # no in-place build


def _venv_with_deps(path: Path) -> Path:
    """A fresh venv (no pip, no specmd) that sees this environment's dependencies through a .pth file. The
    .pth adds a plain path, not a site directory, so the editable install's own .pth hook is not run: only
    the wheel's ``specmd`` can be imported."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    py = path / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "specmd_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py


def _source_tree(dst: Path, built: bool) -> None:
    """The source tree as a user clones it (no in-place build); with ``built``, the install's build products
    beside it where a wheel build looks for them, each with its time: Cython's translations (``build/cython``)
    and the compiled modules (``build/lib.<platform>``). A build then translates and compiles only what is older
    than its sources -- nothing, in CI's checkout, where ``pip install -e .`` has just built them from these very
    sources -- and packages the rest: what this test checks is the wheel (its modules, manifest, configs, console
    script), not the compiler again (the install ran it; it took 140 of this test's 150 s)."""
    shutil.copytree(ROOT, dst, ignore=IGNORE)
    if not built or not (ROOT / "build" / "cython").is_dir():
        return
    shutil.copytree(ROOT / "build" / "cython", dst / "build" / "cython")
    lib = dst / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for so in (ROOT / "specmd").rglob(f"*{suffix}"):
        target = lib / so.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, target)
    for product in (dst / "build").rglob("*"):  # newer than whatever they depend on outside the tree, too: the
        os.utime(product)  # install's isolated build had its own Cython, and this venv's may be newer (CI: 12 s)


def test_wheel_in_fresh_venv_runs_default_job(tmp_path, mirror):
    src = tmp_path / "src"
    _source_tree(src, built=True)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", STORED, "-w",
                    str(dist), str(src)], check=True)
    (wheel,) = dist.glob("specmd-*.whl")
    import zipfile

    from specmd import native

    names = set(zipfile.ZipFile(wheel).namelist())
    for src in native.sources():  # the compiled engine is in the wheel, with its manifest
        assert any(n.startswith(f"specmd/{src[:-3]}.") and n.endswith((".so", ".pyd")) for n in names), src
    assert f"specmd/{native.MANIFEST}" in names
    py = _venv_with_deps(tmp_path / "venv")
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True)

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "SPECMD_DATA_MIRROR": str(mirror), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_MODE": "offline", "PYTHONPATH": ""}
    where = subprocess.run([str(py), "-W", "error::RuntimeWarning", "-c",
                            "import specmd, pathlib; assert pathlib.Path(specmd.CONF_DIR, 'config.yaml').is_file(); "
                            "from specmd import native; assert native.summary() == {'engine': 'compiled'}, native.summary(); "
                            "print(specmd.__file__)"], cwd=work,
                           env={**env, "SPECMD_PURE_PYTHON": ""}, check=True, capture_output=True, text=True).stdout.strip()
    assert Path(where).is_relative_to(tmp_path / "venv"), where  # the installed wheel, not the checkout
    # the console script and the configs shipped in the wheel: the default job, smaller
    out = subprocess.run([str(tmp_path / "venv" / "bin" / "specmd"), "eval.limit=1", "eval.max_gen_toks=4",
                          "hydra.run.dir=run"], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # the launcher configs are package data too (three levels down: conf/hydra/launcher)
    cfg = subprocess.run([str(tmp_path / "venv" / "bin" / "specmd"), "hydra/launcher=specmd_joblib", "--cfg", "hydra"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert cfg.returncode == 0 and "JoblibLauncher" in cfg.stdout, cfg.stderr[-2000:]
    res = json.loads((work / "run" / "results.json").read_text())
    assert res["config"]["model"]["name"] == "deep_olmoe" and res["cache"]["requests"] > 0
    assert "gsm8k" in res["tasks"]


def test_a_wheel_built_without_the_compiler_runs_pure_python_with_one_warning(tmp_path):
    """The build's fallback (no Cython, no C compiler, or SPECMD_NO_COMPILE=1): the package installs and
    runs its sources, and says so once."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", STORED, "-w",
                    str(dist), str(src)], check=True, env={**os.environ, "SPECMD_NO_COMPILE": "1"})
    (wheel,) = dist.glob("specmd-*.whl")
    import zipfile

    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith((".so", ".pyd"))]
    py = _venv_with_deps(tmp_path / "venv")
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True)
    env = {**os.environ, "PYTHONPATH": "", "SPECMD_PURE_PYTHON": ""}
    out = subprocess.run([str(py), "-W", "always::RuntimeWarning", "-c",
                          "import specmd.replay.driver; from specmd import native; print(native.summary()['engine'])"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "pure"
    assert out.stderr.count("RuntimeWarning") == 1 and "not built" in out.stderr, out.stderr[-2000:]
