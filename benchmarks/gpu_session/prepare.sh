#!/usr/bin/env bash
# For a session lent a GPU through this workplace's device tool (whose machine reaches no package index and
# takes at most 64 MiB of working tree): run here, in the repository root, after `pip install -e .`. Writes
# .gpu/ (ignored): the pure-Python wheels the machine's image lacks (transformers trimmed to the families
# gpu_check loads: 13 MB -> 4.5 MB with the rest), the Cython-generated C of the compiled engine (compiled
# there for its Python by build_native.py in ~25 s), and run.sh. Then, with the deep-mixtral weights moved
# aside (the tree must fit), one device call: `bash .gpu/run.sh` carrying .gpu and specmd/_native.json.
set -euo pipefail
mkdir -p .gpu/whl && grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/whl"
python3 -m pip download -q $P transformers==5.23.0 hydra-core==1.3.8 omegaconf==2.3.0 termcolor==3.2.0
python3 -m pip wheel -q --no-deps -w .gpu/whl antlr4-python3-runtime==4.9.3 hqq==0.2.8.post1
python3 - <<'PY'
import glob, zipfile
keep = {"auto", "deepseek_v2", "deepseek_v3", "gpt_oss", "mixtral", "olmoe", "phimoe", "qwen2_moe", "qwen3_moe",
        "encoder_decoder", "llama", "mistral", "qwen2", "qwen3", "olmo", "olmo2"}
with zipfile.ZipFile(".gpu/site.zip", "w", zipfile.ZIP_DEFLATED) as out:
    for w in glob.glob(".gpu/whl/*.whl"):
        z = zipfile.ZipFile(w)
        for i in z.infolist():
            p = i.filename.split("/")
            if p[0] == "transformers" and len(p) > 3 and p[1] == "models" and p[2] not in keep \
                    and not (p[3] == "__init__.py" or p[3].startswith("configuration_")):
                continue
            out.writestr(i, z.read(i.filename))
PY
rm -rf .gpu/whl
tar -cJf .gpu/csrc.tar.xz -C build cython
cp benchmarks/gpu_session/build_native.py benchmarks/gpu_session/run.sh .gpu/
ls -la .gpu
