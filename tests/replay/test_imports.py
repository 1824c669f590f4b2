"""Importing routing traces from other engines (specmd.replay.formats): JSONL, llama.cpp moe-trace CSV, .npy, vLLM,
and a format added by one registered parser."""

import io
import json
import re
import warnings
import zipfile

import numpy as np
import pytest
from tests.conftest import ROOT

from specmd.errors import ConfigError
from specmd.replay.formats.vllm import VLLM_FIELDS
from specmd.replay.imports import ImportOptions, load_import

# 2 sequences (ids 7 then 3, by first appearance) x 3 tokens x 2 layers, E=8, k=2
EXPERTS = {
    (7, 0, 0): [1, 2], (7, 0, 1): [3, 4], (7, 1, 0): [1, 5], (7, 1, 1): [0, 7],
    (7, 2, 0): [6, 2], (7, 2, 1): [3, 1], (3, 0, 0): [0, 1], (3, 0, 1): [2, 3],
    (3, 1, 0): [4, 5], (3, 1, 1): [6, 7], (3, 2, 0): [7, 0], (3, 2, 1): [5, 4],
}
# the file's order is scrambled within each sequence; passes must come out sequence, token, layer
FILE_ORDER = [(7, 1, 1), (7, 0, 0), (7, 2, 0), (7, 0, 1), (7, 1, 0), (7, 2, 1),
              (3, 2, 1), (3, 0, 0), (3, 1, 1), (3, 0, 1), (3, 2, 0), (3, 1, 0)]
PASSES = [[0, 1, 1], [1, 1, 2], [1, 1, 3], [0, 1, 1], [1, 1, 2], [1, 1, 3]]
CALLS = [[p, layer, 2 * p + layer, 1] for p in range(6) for layer in range(2)]
INDEX = [[1, 2], [3, 4], [1, 5], [0, 7], [6, 2], [3, 1], [0, 1], [2, 3], [4, 5], [6, 7], [7, 0], [5, 4]]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def canonical_records(keys=("seq", "token", "layer", "experts")):
    s, t, la, e = keys
    return [{s: q, t: tok, la: layer, e: EXPERTS[q, tok, layer]} for q, tok, layer in FILE_ORDER]


def test_jsonl_exact_arrays(tmp_path):
    f = write_jsonl(tmp_path / "r.jsonl", canonical_records())
    tr = load_import(f, "jsonl", ImportOptions(num_experts=8))
    assert tr.passes.dtype == np.int64 and tr.calls.dtype == np.int64
    assert tr.passes.tolist() == PASSES
    assert tr.calls.tolist() == CALLS
    assert tr.index.dtype == np.uint8
    assert tr.index.tolist() == INDEX
    assert tr.weights is None and tr.logits is None and tr.signal_index is None and tr.signal_logits is None
    assert tr.depth == 0
    assert tr.path == str(f)
    m = tr.meta.to_dict()  # what a specmd trace of it would write as meta.json
    assert m["format"] == "specmd-trace" and m["version"] == 1 and m["depth"] == 0 and m["logits"] == "none"
    g = m["geometry"]
    assert (g["num_layers"], g["num_experts"], g["top_k"], g["expert_bytes"], g["total_bytes"]) == (2, 8, 2, 1, 16)
    assert (g["hidden_size"], g["dense_params"], g["layer_ids"]) == (0, [0, 0], [0, 1])
    assert m["scoring"] == {"sigmoid": False, "renorm": True, "scale": 1.0}
    assert m["store"] == {"native_bits": 16, "bytes_of": {"native": 1}}
    assert m["source"] == {"format": "jsonl", "path": str(f), "records": 12, "sequences": 2}
    assert tr.meta.imported == "jsonl" and tr.meta.geometry.num_experts == 8
    assert any(n.startswith("replay.expert_bytes not set: expert_bytes=1") for n in tr.notes)
    assert any(n.startswith("replay.model_bytes not set") for n in tr.notes)
    assert any("no dense/attention compute time is modelled" in n for n in tr.notes)
    assert not any("skipped" in n for n in tr.notes)
    # requests: distinct experts per call, summed
    assert tr.requests == 24


def test_jsonl_bytes_from_options(tmp_path):
    f = write_jsonl(tmp_path / "r.jsonl", canonical_records())
    tr = load_import(f, "jsonl", ImportOptions(num_experts=8, expert_bytes=1000, model_bytes=50_000))
    g = tr.meta.geometry
    assert (g.expert_bytes, g.total_bytes) == (1000, 50_000)
    assert tr.meta.store.bytes_of == {"native": 1000}
    assert not any("expert_bytes not set" in n or "model_bytes not set" in n for n in tr.notes)


@pytest.mark.parametrize("keys", [("request_id", "pos", "layer_id", "topk_ids"),
                                  ("sequence", "position", "layer", "expert_ids"),
                                  ("seq_id", "token_idx", "layer_id", "ids")])
def test_jsonl_aliases(tmp_path, keys):
    recs = canonical_records(keys)
    if keys[0] == "request_id":  # string request ids keep first-appearance order
        for r in recs:
            r["request_id"] = {7: "cmpl-z", 3: "cmpl-a"}[r["request_id"]]
    f = write_jsonl(tmp_path / "r.jsonl", recs)
    tr = load_import(f, "jsonl", ImportOptions(num_experts=8))
    assert tr.passes.tolist() == PASSES
    assert tr.calls.tolist() == CALLS
    assert tr.index.tolist() == INDEX


def test_jsonl_default_sequence(tmp_path):
    recs = [{"token": t, "layer": la, "experts": [t, la + 4]} for t in range(3) for la in range(2)]
    tr = load_import(write_jsonl(tmp_path / "r.jsonl", recs), "jsonl", ImportOptions(num_experts=8))
    assert tr.passes.tolist() == [[0, 1, 1], [1, 1, 2], [1, 1, 3]]
    assert tr.index.tolist() == [[0, 4], [0, 5], [1, 4], [1, 5], [2, 4], [2, 5]]
    assert tr.meta.source["sequences"] == 1


def test_jsonl_noncontiguous_layers_mapped(tmp_path):
    # DeepSeek-style: layer 0 is dense, MoE layers are model layers 1, 3 and 4
    recs = [{"seq": 0, "token": t, "layer": la, "experts": [la, t + 5]} for t in (0, 1) for la in (4, 1, 3)]
    with pytest.warns(UserWarning, match=r"layer id\(s\) \[2\] absent from every token"):  # an irregular gap
        tr = load_import(write_jsonl(tmp_path / "r.jsonl", recs), "jsonl", ImportOptions(num_experts=8))
    assert tr.meta.geometry.layer_ids == [1, 3, 4]
    assert tr.meta.geometry.num_layers == 3
    assert tr.calls.tolist() == [[0, 0, 0, 1], [0, 1, 1, 1], [0, 2, 2, 1], [1, 0, 3, 1], [1, 1, 4, 1], [1, 2, 5, 1]]
    assert tr.index.tolist() == [[1, 5], [3, 5], [4, 5], [1, 6], [3, 6], [4, 6]]
    assert tr.meta.geometry.dense_params == [0, 0, 0]


def test_jsonl_weights_and_logits_kept(tmp_path):
    recs = []
    for t in range(2):
        for la in range(2):
            logits = [float(i) for i in range(4)]
            logits[t + la] = 10.0
            recs.append({"token": t, "layer": la, "experts": [t + la, 3], "topk_weights": [0.75, 0.25],
                         "router_logits": logits})
    f = write_jsonl(tmp_path / "r.jsonl", recs)
    tr = load_import(f, "jsonl", ImportOptions())  # E comes from the logits
    assert tr.meta.geometry.num_experts == 4
    assert tr.meta.logits == "fp32"
    assert tr.weights.dtype == np.float16 and tr.weights.tolist() == [[0.75, 0.25]] * 4
    assert tr.logits.dtype == np.float32
    assert tr.logits.tolist() == [[10.0, 1.0, 2.0, 3.0], [0.0, 10.0, 2.0, 3.0], [0.0, 10.0, 2.0, 3.0],
                                  [0.0, 1.0, 10.0, 3.0]]
    assert tr.index.tolist() == [[0, 3], [1, 3], [1, 3], [2, 3]]
    assert not any("no router weights" in n for n in tr.notes)
    with pytest.raises(ConfigError, match=r"r\.jsonl, line 1: 4 logits, but replay.num_experts is 8"):
        load_import(f, "jsonl", ImportOptions(num_experts=8))


def test_jsonl_logits_only_uses_top_k(tmp_path):
    recs = [{"token": 0, "layer": 0, "logits": [0.1, 0.9, 0.5, 0.7]},
            {"token": 1, "layer": 0, "logits": [0.8, 0.2, 0.3, 0.1]}]
    f = write_jsonl(tmp_path / "r.jsonl", recs)
    tr = load_import(f, "jsonl", ImportOptions(top_k=2))
    assert tr.index.tolist() == [[1, 3], [0, 2]]
    assert tr.meta.geometry.top_k == 2
    with pytest.raises(ConfigError, match=r"line 1: no expert list, only logits; set replay.top_k"):
        load_import(f, "jsonl", ImportOptions())


def test_jsonl_positions_not_from_zero_noted(tmp_path):
    recs = [{"seq": 0, "token": t, "layer": 0, "experts": [t - 100]} for t in (100, 101, 102)]
    tr = load_import(write_jsonl(tmp_path / "r.jsonl", recs), "jsonl", ImportOptions(num_experts=4))
    assert tr.passes.tolist() == [[0, 1, 1], [1, 1, 2], [1, 1, 3]]
    assert any(n.startswith("1 sequence(s) have token positions other than 0..n-1 (first: seq 0, positions "
                            "100..102 for 3 tokens)") for n in tr.notes)


GOOD = '{"seq": 0, "token": 0, "layer": 0, "experts": [1, 2], "weights": [0.5, 0.5]}\n'


def _line(tok, experts, weights=(0.5, 0.5), layer=0):
    rec = {"seq": 0, "token": tok, "layer": layer, "experts": list(experts), "weights": list(weights)}
    return json.dumps(rec) + "\n"


@pytest.mark.parametrize("text, match", [
    (GOOD + _line(1, [1, 8]), r"r\.jsonl, line 2: expert id 8 out of range \[0, 8\)"),
    (GOOD + "\n" + _line(1, [1, 2]) + _line(2, [-1, 2]), r"r\.jsonl, line 4: negative expert id -1"),
    (GOOD + '{"seq": 0, "token": 1, "layer": 0, "experts": [1, 2\n', r"r\.jsonl, line 2: malformed JSON"),
    (GOOD + _line(1, [1, 2]) + _line(2, [1, 2, 3], [0.3, 0.3, 0.4]),
     r"r\.jsonl, line 3: 3 experts, but line 1 has 2: mixed top-k"),
    (GOOD + _line(1, [1, 2], [1.0]), r"r\.jsonl, line 2: 1 weights for 2 experts"),
    (GOOD + _line(1, [3, 3]), r"r\.jsonl, line 2: expert id 3 appears twice in one record"),
    (GOOD + _line(1, [1, 2]) + _line(0, [4, 5]), r"r\.jsonl, line 3: duplicate record for seq 0 token 0 layer 0 "
                                                 r"\(first at line 1\)"),
    (GOOD + '{"seq": 0, "token": 1, "layer": 0, "experts": [1, 2]}\n', r"r\.jsonl, line 2: weights absent here"),
    (GOOD + '{"seq": 0, "token": 1.5, "layer": 0, "experts": [1, 2], "weights": [1, 0]}\n',
     r"r\.jsonl, line 2: token position 1.5 is not an integer"),
    (GOOD + '{"seq": 0, "token": 1, "layer": 0, "experts": [1, 2.5], "weights": [1, 0]}\n',
     r"r\.jsonl, line 2: expert id 2.5 is not an integer"),
    (GOOD + '{"seq": 0, "layer": 0, "experts": [1, 2], "weights": [1, 0]}\n', r"r\.jsonl, line 2: no token position"),
    ("[1, 2]\n", r"r\.jsonl, line 1: expected a JSON object"),
])
def test_jsonl_errors_name_the_line(tmp_path, text, match):
    f = tmp_path / "r.jsonl"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_import(f, "jsonl", ImportOptions(num_experts=8))


def test_empty_file_unknown_format_and_unknown_experts(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text("\n\n")
    with pytest.raises(ConfigError, match=r"r\.jsonl: empty file"):
        load_import(f, "jsonl", ImportOptions(num_experts=8))
    c = tmp_path / "r.csv"
    c.write_text("")
    with pytest.raises(ConfigError, match=r"r\.csv: empty file"):
        load_import(c, "llama_csv", ImportOptions(num_experts=8))
    f.write_text(GOOD)
    from specmd.replay.formats import FORMATS

    with pytest.raises(ConfigError, match=rf"replay.format='parquet' .*valid choices: {', '.join(FORMATS.names())}"):
        load_import(f, "parquet", ImportOptions(num_experts=8))
    with pytest.raises(ConfigError, match=r"r\.jsonl: the number of experts is unknown .*set replay.num_experts"):
        load_import(f, "jsonl", ImportOptions())
    with pytest.raises(ConfigError, match=r"no such file"):
        load_import(tmp_path / "nope.jsonl", "jsonl", ImportOptions(num_experts=8))


def _grid(tokens, layers, drop=()):
    return [{"token": t, "layer": la, "experts": [(t + la) % 4]} for t in range(tokens) for la in range(layers)
            if (t, la) not in drop]


def test_missing_cell_skipped_with_note_and_warning(tmp_path):
    f = write_jsonl(tmp_path / "r.jsonl", _grid(50, 2, drop={(5, 1)}))  # 1 of 100 cells = max_missing
    with pytest.warns(UserWarning, match=r"skipped 1 missing \(token, layer\) cell: seq 0 token 5 layer 1"):
        tr = load_import(f, "jsonl", ImportOptions(num_experts=4))
    assert len(tr.passes) == 50 and len(tr.calls) == 99 and len(tr.index) == 99
    assert tr.calls[8:13].tolist() == [[4, 0, 8, 1], [4, 1, 9, 1], [5, 0, 10, 1], [6, 0, 11, 1], [6, 1, 12, 1]]
    assert tr.index[8:13, 0].tolist() == [0, 1, 1, 2, 3]
    assert tr.passes[5].tolist() == [1, 1, 6]
    assert ("skipped 1 missing (token, layer) cell: seq 0 token 5 layer 1 (1.00% of 100 cells; "
            "replay.max_missing=0.01)") in tr.notes


def test_missing_cells_over_threshold_raise(tmp_path):
    f = write_jsonl(tmp_path / "r.jsonl", _grid(50, 2, drop={(5, 1), (7, 0)}))
    with pytest.raises(ConfigError, match=r"r\.jsonl: 2 of 100 \(token, layer\) cells are missing \(2.00%, above "
                                          r"replay.max_missing=0.01\): seq 0 token 5 layer 1, seq 0 token 7 layer 0"):
        load_import(f, "jsonl", ImportOptions(num_experts=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = load_import(f, "jsonl", ImportOptions(num_experts=4, max_missing=0.05))
    assert len(caught) == 1 and "skipped 2 missing (token, layer) cells" in str(caught[0].message)
    assert len(tr.calls) == 98


def test_npy_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    arr = np.stack([np.stack([rng.permutation(300)[:3] for _ in range(4)]) for _ in range(5)]).astype(np.int32)
    f = tmp_path / "r.npy"
    np.save(f, arr)
    tr = load_import(f, "npy", ImportOptions(num_experts=300))
    assert tr.index.dtype == np.int16  # E > 256
    np.testing.assert_array_equal(tr.index, arr.reshape(20, 3))
    assert tr.passes.tolist() == [[0, 1, 1], [1, 1, 2], [1, 1, 3], [1, 1, 4], [1, 1, 5]]
    assert tr.calls.tolist() == [[p, la, 4 * p + la, 1] for p in range(5) for la in range(4)]
    assert tr.meta.geometry.layer_ids == [0, 1, 2, 3]
    assert tr.meta.source["records"] == 20 and tr.meta.source["format"] == "npy"
    arr[1, 1, 2] = -3
    np.save(f, arr)
    with pytest.raises(ConfigError, match=r"r\.npy, record 5 \(token 1, layer 1\): negative expert id -3"):
        load_import(f, "npy", ImportOptions(num_experts=300))
    np.save(f, arr.astype(np.float32))
    with pytest.raises(ConfigError, match=r"r\.npy: expected an integer array \[tokens, layers, k\], got dtype"):
        load_import(f, "npy", ImportOptions(num_experts=300))


def test_llama_csv_headerless_moe_trace(tmp_path):
    # llama-moe-trace rows pos,layer,id0,id1 in execution order: a 3-token prompt ubatch (negative pos,
    # layer-major), two decode steps, then a second run concatenated (prompt after decode = new sequence).
    rows = ["-3,0,1,2", "-2,0,3,4", "-1,0,5,6", "-3,1,7,0", "-2,1,1,3", "-1,1,2,4",
            "0,0,0,1", "0,1,2,3", "1,0,4,5", "1,1,6,7",
            "-2,0,5,1", "-1,0,6,2", "-2,1,7,3", "-1,1,0,4", "0,0,1,2", "0,1,3,4"]
    f = tmp_path / "trace.csv"
    f.write_text("\n".join(rows) + "\n")
    tr = load_import(f, "llama_csv", ImportOptions(num_experts=8))
    assert tr.passes.tolist() == [[0, 1, 1], [1, 1, 2], [1, 1, 3], [1, 1, 4], [1, 1, 5],
                                  [0, 1, 1], [1, 1, 2], [1, 1, 3]]
    assert tr.calls.tolist() == [[p, la, 2 * p + la, 1] for p in range(8) for la in range(2)]
    assert tr.index.tolist() == [[1, 2], [7, 0], [3, 4], [1, 3], [5, 6], [2, 4], [0, 1], [2, 3], [4, 5], [6, 7],
                                 [5, 1], [7, 3], [6, 2], [0, 4], [1, 2], [3, 4]]
    assert tr.meta.geometry.layer_ids == [0, 1]
    assert tr.meta.source == {"format": "llama_csv", "path": str(f), "records": 16, "sequences": 2}
    assert tr.notes[0] == ("llama.cpp moe-trace CSV (pos,layer,id0..): 2 run(s), 10 prompt rows (negative pos) and "
                           "6 decode rows; prompt tokens replay one token per pass (the prefill batching is not kept)")


def test_llama_csv_other_prompt_encoding_and_repeats(tmp_path):
    # the -(pos + j + 1) fork encoding: the first prompt token is -1; order is by appearance, not value.
    # A prompt-only second run starts at its repeated (pos, layer).
    rows = ["-1,3,0", "-2,3,1", "-1,5,2", "-2,5,3", "0,3,4", "0,5,5", "-1,3,6", "-1,5,7"]
    f = tmp_path / "trace.csv"
    f.write_text("\n".join(rows) + "\n")
    tr = load_import(f, "llama_csv", ImportOptions(num_experts=8))
    assert tr.passes.tolist() == [[0, 1, 1], [1, 1, 2], [1, 1, 3], [0, 1, 1]]
    assert tr.index[:, 0].tolist() == [0, 2, 1, 3, 4, 5, 6, 7]
    assert tr.calls[:, 1].tolist() == [0, 1] * 4
    assert tr.meta.geometry.layer_ids == [3, 5]
    assert tr.meta.geometry.top_k == 1


def test_llama_csv_headerless_errors(tmp_path):
    f = tmp_path / "trace.csv"
    f.write_text("-1,0,1,2\n-1,1,3\n")
    with pytest.raises(ConfigError, match=r"trace\.csv, line 2: 1 experts, but line 1 has 2: mixed top-k"):
        load_import(f, "llama_csv", ImportOptions(num_experts=8))
    f.write_text("-1,0,1,2\n\n-1,1,3,9\n")
    with pytest.raises(ConfigError, match=r"trace\.csv, line 3: expert id 9 out of range \[0, 8\)"):
        load_import(f, "llama_csv", ImportOptions(num_experts=8))
    f.write_text("-1,0,1,2\n-1,1,3,x\n")
    with pytest.raises(ConfigError, match=r"trace\.csv, line 2: non-integer field"):
        load_import(f, "llama_csv", ImportOptions(num_experts=8))
    f.write_text("-1,0,1,2\n-1,1,3,3\n")
    with pytest.raises(ConfigError, match=r"trace\.csv, line 2: expert id 3 appears twice"):
        load_import(f, "llama_csv", ImportOptions(num_experts=8))


def test_header_csv_list_column(tmp_path):
    lines = ["seq,pos,layer,experts,weights"]
    lines += [f"{q},{t},{la},{';'.join(map(str, EXPERTS[q, t, la]))},0.5|0.25" for q, t, la in FILE_ORDER]
    f = tmp_path / "r.csv"
    f.write_text("\n".join(lines) + "\n")
    tr = load_import(f, "llama_csv", ImportOptions(num_experts=8))
    assert tr.passes.tolist() == PASSES
    assert tr.calls.tolist() == CALLS
    assert tr.index.tolist() == INDEX
    assert tr.weights.dtype == np.float16 and tr.weights.tolist() == [[0.5, 0.25]] * 12
    # space-joined experts in a quoted cell work too
    f.write_text("token,layer,experts\n0,0,\"[1 2]\"\n1,0,\"2 3\"\n")
    tr = load_import(f, "llama_csv", ImportOptions(num_experts=8))
    assert tr.index.tolist() == [[1, 2], [2, 3]]
    assert tr.weights is None and any(n == "the file has no router weights" for n in tr.notes)


def test_header_csv_indexed_columns(tmp_path):
    lines = ["request_id,token,layer_id,expert_0,expert_1,weight_0,weight_1"]
    lines += [f"r{q},{t},{la},{EXPERTS[q, t, la][0]},{EXPERTS[q, t, la][1]},0.75,0.125" for q, t, la in FILE_ORDER]
    f = tmp_path / "r.csv"
    f.write_text("\n".join(lines) + "\n")
    tr = load_import(f, "llama_csv", ImportOptions(num_experts=8))
    assert tr.passes.tolist() == PASSES
    assert tr.calls.tolist() == CALLS
    assert tr.index.tolist() == INDEX
    assert tr.weights.tolist() == [[0.75, 0.125]] * 12
    lines[3] = "r7,2,0,6,,0.75,0.125"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"r\.csv, line 4: 1 experts, but line 2 has 2: mixed top-k"):
        load_import(f, "llama_csv", ImportOptions(num_experts=8))
    f.write_text("token,layer,expert_0,expert_1,weight_0\n0,0,1,2,0.5\n")
    with pytest.raises(ConfigError, match=r"r\.csv, line 2: 1 weights for 2 experts"):
        load_import(f, "llama_csv", ImportOptions(num_experts=8))
    f.write_text("token,layer,note\n0,0,x\n")
    with pytest.raises(ConfigError, match=r"r\.csv, line 1: the header names no experts column"):
        load_import(f, "llama_csv", ImportOptions(num_experts=8))


# ---- vLLM --enable-return-routed-experts ---------------------------------------------------------------------

def _vllm_arrays(rng, tokens, layers=3, k=2, experts=8):
    return np.stack([np.stack([rng.choice(experts, k, replace=False) for _ in range(layers)])
                     for _ in range(tokens)]).astype(np.int16)


def test_vllm_prompt_is_one_prefill_pass_then_decode_steps(tmp_path):
    rng = np.random.default_rng(0)
    prompt, gen = _vllm_arrays(rng, 4), _vllm_arrays(rng, 3)  # [tokens, layers, k] int16, as vLLM returns them
    f = tmp_path / "routes.npz"
    np.savez(f, prompt_routed_experts=prompt, routed_experts=gen)
    tr = load_import(f, "vllm", ImportOptions(num_experts=8))
    # one prefill pass of the 4 prompt tokens (context 4), then 3 decode passes (context 5, 6, 7)
    assert tr.passes.tolist() == [[0, 4, 4], [1, 1, 5], [1, 1, 6], [1, 1, 7]]
    # the prefill pass: one call per layer with the 4 tokens' rows, in layer order
    assert tr.calls[:3].tolist() == [[0, 0, 0, 4], [0, 1, 4, 4], [0, 2, 8, 4]]
    assert tr.calls[3:].tolist() == [[p, la, 12 + 3 * (p - 1) + la, 1] for p in (1, 2, 3) for la in range(3)]
    assert tr.index[0:4].tolist() == prompt[:, 0].tolist() and tr.index[8:12].tolist() == prompt[:, 2].tolist()
    assert tr.index[12:15].tolist() == gen[0].tolist()
    assert tr.meta.geometry.top_k == 2 and tr.meta.source["format"] == "vllm"


def test_vllm_jsonl_and_npz_of_several_requests_agree(tmp_path):
    import json

    rng = np.random.default_rng(1)
    reqs = {"a": (_vllm_arrays(rng, 5), _vllm_arrays(rng, 2)), "b": (_vllm_arrays(rng, 3), _vllm_arrays(rng, 4))}
    j = tmp_path / "routes.jsonl"
    j.write_text("".join(json.dumps({"request_id": r, "prompt_routed_experts": p.tolist(),
                                     "routed_experts": g.tolist()}) + "\n" for r, (p, g) in reqs.items()))
    z = tmp_path / "routes.npz"
    np.savez(z, **{f"{r}/{f}": a for r, (p, g) in reqs.items() for f, a in (("prompt_routed_experts", p),
                                                                             ("routed_experts", g))})
    a, b = load_import(j, "vllm", ImportOptions(num_experts=8)), load_import(z, "vllm", ImportOptions(num_experts=8))
    assert a.passes.tolist() == b.passes.tolist() == [[0, 5, 5], [1, 1, 6], [1, 1, 7], [0, 3, 3]] + \
        [[1, 1, 4 + i] for i in range(4)]
    assert a.index.tolist() == b.index.tolist() and a.calls.tolist() == b.calls.tolist()
    assert a.meta.source["sequences"] == 2


@pytest.mark.parametrize("content,match", [
    ({"routed_experts": [[1, 2], [3, 4]]}, r"line 1: routed_experts of request 0 must be \[tokens, layers, top_k\], got shape \(2, 2\)"),
    ({"request_id": "x"}, r"line 1: request 'x' has no routing"),
    ({"routed_experts": [[[1.5, 2.0]]]}, r"must hold integer expert ids, got dtype float64"),
    ({"routed_experts": [[[1, 2]], [[3]]]}, r"routed_experts of request 0 is not a \[tokens, layers, top_k\] array"),
])
def test_vllm_bad_requests_are_named(tmp_path, content, match):
    import json

    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps(content) + "\n")
    with pytest.raises(ConfigError, match=match):
        load_import(f, "vllm", ImportOptions(num_experts=8))


def test_vllm_mismatched_requests_and_stray_arrays(tmp_path):
    rng = np.random.default_rng(2)
    z = tmp_path / "r.npz"
    np.savez(z, **{"a/routed_experts": _vllm_arrays(rng, 2), "b/routed_experts": _vllm_arrays(rng, 2, layers=4)})
    with pytest.raises(ConfigError, match=r"request 'b' has \[layers, top_k\] = \[4, 2\], the requests before it \[3, 2\]"):
        load_import(z, "vllm", ImportOptions(num_experts=8))
    np.savez(z, routed_experts=_vllm_arrays(rng, 2), logits=np.zeros(3))
    with pytest.raises(ConfigError, match=r"array 'logits' is not one of prompt_routed_experts, routed_experts"):
        load_import(z, "vllm", ImportOptions(num_experts=8))
    j = tmp_path / "r.jsonl"
    j.write_text("\n")
    with pytest.raises(ConfigError, match=r"empty file, no requests"):
        load_import(j, "vllm", ImportOptions(num_experts=8))


def test_vllm_bad_value_names_its_request_token_and_layer(tmp_path):
    """Not square (4 layers, 9 tokens in request 'b'), so a location with token and layer swapped (or the
    tokens counted from the file's start, not the request's) names another cell, here one that cannot exist."""
    rng = np.random.default_rng(3)
    a = _vllm_arrays(rng, 3, layers=4), _vllm_arrays(rng, 2, layers=4)
    b = _vllm_arrays(rng, 5, layers=4), _vllm_arrays(rng, 4, layers=4)
    b[1][2, 3] = [1, 9]  # request b's generated token 7 (5 prompt + 2), layer 3: expert 9 of 8
    z = tmp_path / "r.npz"
    np.savez(z, **{f"{r}/{f}": x for r, arrays in (("a", a), ("b", b)) for f, x in zip(VLLM_FIELDS, arrays)})
    with pytest.raises(ConfigError, match=r"^" + re.escape(f"{z}, arrays b/*: request 'b' token 7 (generated) layer 3: "
                                                            "expert id 9 out of range [0, 8)")):
        load_import(z, "vllm", ImportOptions(num_experts=8))


def _npy_bytes(a) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def _zip_of(members: dict) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def _flip_in_member(data: bytes) -> bytes:
    """One bit of the first member's array data flipped: a valid .npy, failing its zip CRC."""
    data = bytearray(data)
    data[data.find(b"\x93NUMPY") + 128 + 3] ^= 1  # past the 128-byte .npy header
    return bytes(data)


_GOOD = _vllm_arrays(np.random.default_rng(4), 4)


@pytest.mark.parametrize("name,content,match", [
    ("r.npz", b'{"routed_experts": [[[1, 2]]]}\n', r"not a \.npz archive \(it does not start with a zip's signature"),
    ("r.npz", _npy_bytes(_GOOD), r"a single \.npy array, not a vllm container .* is replay\.format=npy"),
    ("r.npy", _npy_bytes(_GOOD), r"a single \.npy array, not a vllm container"),
    ("r.npz", _zip_of({"routed_experts.npy": _npy_bytes(_GOOD)})[:40],
     r"not a readable \.npz archive \(BadZipFile: .*; truncated\?\); expected a \.npz"),
    ("r.npz", _zip_of({"a/routed_experts.npy": _npy_bytes(np.array([[1, 2], "x"], dtype=object))}),
     r"array 'a/routed_experts' cannot be read \(ValueError: Object arrays cannot be loaded when allow_pickle=False\); "
     r"expected an integer \.npy array \[tokens, layers, top_k\]"),
    ("r.npz", _zip_of({"routed_experts.npy": _npy_bytes(_GOOD)[:-5]}),
     r"array 'routed_experts' cannot be read \(ValueError: EOF"),
    ("r.npz", _flip_in_member(_zip_of({"routed_experts.npy": _npy_bytes(_GOOD)})),
     r"array 'routed_experts' cannot be read \(BadZipFile: Bad CRC-32"),
    ("r.npz", _zip_of({"prompt_routed_experts": b"1,2\n3,4\n"}),
     r"array 'prompt_routed_experts' is not a \.npy array \(8 bytes of something else\)"),
], ids=["text-as-npz", "npy-as-npz", "npy", "truncated-archive", "object-array", "truncated-member", "bad-crc",
        "member-not-npy"])
def test_vllm_bad_containers_name_the_file_and_member(tmp_path, name, content, match):
    """A renamed file, a truncated archive, a member that is an object array (never unpickled), truncated,
    failing its CRC or no .npy at all: a ConfigError (one line, exit 2) naming the file and the member."""
    f = tmp_path / name
    f.write_bytes(content)
    with pytest.raises(ConfigError, match=r"^" + re.escape(str(f)) + ": " + match):
        load_import(f, "vllm", ImportOptions(num_experts=8))


def test_vllm_container_is_told_by_its_content(tmp_path):
    """An archive under another name is still read as one (the first bytes decide, not the suffix)."""
    z = tmp_path / "r.npz"
    np.savez(z, routed_experts=_GOOD)
    renamed = tmp_path / "routes.jsonl"
    z.rename(renamed)
    assert load_import(renamed, "vllm", ImportOptions(num_experts=8)).index.tolist() == _GOOD.reshape(-1, 2).tolist()


# ---- degenerate captures ---------------------------------------------------------------------------------------

def test_every_token_routed_identically_is_refused(tmp_path):
    recs = [{"token": t, "layer": la, "experts": [1, 5]} for t in range(16) for la in range(3)]
    with pytest.raises(ConfigError, match=r"every one of the 16 tokens is routed to the same experts in every layer"):
        load_import(write_jsonl(tmp_path / "r.jsonl", recs), "jsonl", ImportOptions(num_experts=8))
    with pytest.warns(UserWarning, match="every one of the 4 tokens"):  # below 16 tokens: a warning and a note
        tr = load_import(write_jsonl(tmp_path / "r.jsonl", recs[:12]), "jsonl", ImportOptions(num_experts=8))
    assert any("same experts" in n for n in tr.notes)
    recs[-1] = {"token": 15, "layer": 2, "experts": [5, 2]}  # one token differs: accepted, no warning
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_import(write_jsonl(tmp_path / "r.jsonl", recs), "jsonl", ImportOptions(num_experts=8))


def test_a_layer_absent_from_every_token_is_flagged(tmp_path):
    recs = [{"token": t, "layer": la, "experts": [t % 8, (t + la + 1) % 8]} for t in range(4) for la in (0, 1, 2, 4, 5)]
    with pytest.warns(UserWarning, match=r"layer id\(s\) \[3\] absent from every token"):
        tr = load_import(write_jsonl(tmp_path / "r.jsonl", recs), "jsonl", ImportOptions(num_experts=8))
    assert tr.meta.geometry.layer_ids == [0, 1, 2, 4, 5]
    # a regular stride (every other layer is MoE) is a model, not a gap
    recs = [{"token": t, "layer": la, "experts": [t % 8, (t + la + 2) % 8]} for t in range(4) for la in (1, 3, 5)]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_import(write_jsonl(tmp_path / "r.jsonl", recs), "jsonl", ImportOptions(num_experts=8))


@pytest.mark.parametrize("drop,hint", [
    (lambda t, la: t == 9 and la == 2, "only sequences' last tokens lack layers"),
    (lambda t, la: t > 0 and la == 2, "only decode tokens lack layers, the prompts have them all"),
])
def test_missing_cells_say_what_the_pattern_suggests(tmp_path, drop, hint):
    recs = [{"token": t, "layer": la, "experts": [t % 8, (t + la + 1) % 8]} for t in range(10) for la in range(3)
            if not drop(t, la)]
    with pytest.raises(ConfigError, match=hint) if "decode" in hint else pytest.warns(UserWarning, match=hint):
        load_import(write_jsonl(tmp_path / "r.jsonl", recs), "jsonl", ImportOptions(num_experts=8, max_missing=0.05))


def _toy_parse(path, opts, notes):
    """A whole new format in one function: a line ``<sequence> <token> <layer> <e1>,<e2>,...``."""
    from specmd.replay.formats import Records

    lines = [(n, line.split()) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    names = list(dict.fromkeys(f[0] for _, f in lines))  # sequence ids by first appearance
    return Records(
        seq=np.array([names.index(f[0]) for _, f in lines]), tok=np.array([int(f[1]) for _, f in lines]),
        layer=np.array([int(f[2]) for _, f in lines]),
        experts=np.array([[int(x) for x in f[3].split(",")] for _, f in lines]), weights=None, logits=None,
        loc=lambda i: f"line {lines[i][0]}", seq_names=names, path=str(path))


def test_a_new_format_is_one_registered_parser(tmp_path):
    """A format registered from outside the package: imported, validated and replayed like the built-in
    ones, listed among the valid choices while registered, gone after."""
    from hydra import compose, initialize_config_dir

    from specmd.app import execute
    from specmd.replay.config import ReplayConfig
    from specmd.replay.formats import FORMATS, register_format
    from specmd.replay.trace import read_trace
    from tests.system.test_configs import CONF

    f = tmp_path / "r.toy"
    f.write_text("".join(f"{q} {t} {la} {','.join(map(str, EXPERTS[q, t, la]))}\n" for q, t, la in FILE_ORDER))
    register_format("toy")(_toy_parse)
    try:
        tr = load_import(f, "toy", ImportOptions(num_experts=8))
        assert (tr.passes.tolist(), tr.calls.tolist(), tr.index.tolist()) == (PASSES, CALLS, INDEX)  # as its JSONL
        assert tr.meta.source == {"format": "toy", "path": str(f), "records": 12, "sequences": 2}
        with pytest.raises(ConfigError, match=r"bad\.toy, line 2: expert id 9 out of range \[0, 8\)"):
            bad = tmp_path / "bad.toy"
            bad.write_text("0 0 0 1,2\n0 1 0 9,2\n")
            load_import(bad, "toy", ImportOptions(num_experts=8))
        names = ", ".join(FORMATS.names())  # the shipped formats and toy, sorted
        assert "toy" in names
        with pytest.raises(ConfigError, match=rf"valid choices: {names}$"):
            load_import(f, "parquet", ImportOptions(num_experts=8))
        with pytest.raises(ConfigError, match=rf"valid choices: specmd, {names}$"):
            ReplayConfig(trace=str(f), format="parquet")
        with pytest.raises(ConfigError, match=rf"set replay.format \({names}\)"):
            read_trace(tmp_path)
        over = [f"replay.trace={f}", "replay.format=toy", "replay.num_experts=8", "prefetch=none",
                "hardware.experts_per_layer=3"]
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            res = execute(compose(config_name="config", overrides=over), run_dir=tmp_path / "run")
        assert res["replay"]["format"] == "toy" and res["replay"]["passes"] == 6
        assert res["cache"]["requests"] == 24
    finally:
        FORMATS.unregister("toy")
    assert "toy" not in FORMATS.names()
    with pytest.raises(ConfigError, match=rf"valid choices: {', '.join(FORMATS.names())}$"):
        load_import(f, "toy", ImportOptions(num_experts=8))


def test_format_names_are_checked_when_registered():
    from specmd.replay.formats import FORMATS, register_format

    with pytest.raises(ValueError, match="import format 'jsonl' registered twice"):
        register_format("jsonl")(_toy_parse)
    with pytest.raises(ValueError, match="'specmd' is reserved"):
        register_format("specmd")(_toy_parse)
    shipped = sorted(p.stem for p in (ROOT / "specmd" / "replay" / "formats").glob("*.py")
                     if p.stem not in ("__init__", "base", "build"))  # (base, build: the helpers)
    assert FORMATS.names() == shipped  # one format per file, each registered under its file's name


@pytest.mark.parametrize("fmt,text,match", [
    ("jsonl", "".join(json.dumps({"token": t, "layer": 0, "experts": [1.5 if t == 3 else 1, 2]}) + "\n"
                      for t in range(6)), r"line 4: expert id 1.5 is not an integer"),
    ("jsonl", "".join(json.dumps({"token": t, "layer": 0, "experts": [1, 2], "weights": [0.5, "x" if t == 3 else 0.5]})
                      + "\n" for t in range(6)), r"line 4: weight value 'x' is not a number"),
    ("llama_csv", "token,layer,experts\n" + "".join(f"{t},0,\"1;{2**63 if t == 3 else 2}\"\n" for t in range(6)),
     r"line 5: expert id 9223372036854775808 is out of range"),
])
def test_a_bad_value_that_fills_a_chunk_names_its_line(tmp_path, monkeypatch, fmt, text, match):
    """Rows are converted a chunk at a time; the record that fills a chunk is named like any other (it was an
    IndexError: its line number was appended after its rows)."""
    from specmd.replay.formats.base import Rows

    monkeypatch.setattr(Rows, "CHUNK", 4)
    f = tmp_path / "r.txt"
    f.write_text(text)
    with pytest.raises(ConfigError, match=r"r\.txt, " + match):
        load_import(f, fmt, ImportOptions(num_experts=8))


@pytest.mark.parametrize("encoding, words", [
    ("utf-16", "it starts with a UTF-16 LE byte-order mark; convert it: iconv -f UTF-16 -t UTF-8"),
    ("latin-1", "a byte 0xe9 is not UTF-8"),
])
@pytest.mark.parametrize("header", [False, True])
def test_a_csv_that_is_not_utf8_is_one_error_naming_the_file(tmp_path, encoding, words, header):
    f = tmp_path / "trace.csv"
    text = ("seq,token,layer,expert\n0,0,0,1\n" if header else "0,0,1,2\n-1,0,3,4\n") + "# caf\u00e9\n"
    f.write_bytes(text.encode(encoding))
    with pytest.raises(ConfigError, match=re.escape(f"replay.trace={str(f)!r} with replay.format=llama_csv: not "
                                                    f"UTF-8 text ({words}")):
        load_import(f, "llama_csv", ImportOptions(num_experts=8))


def test_a_jsonl_in_utf16_is_named_and_a_utf8_bom_is_read(tmp_path):
    f = tmp_path / "trace.jsonl"
    rows = "".join(json.dumps({"seq": 0, "token": t, "layer": 0, "experts": [t, t + 1]}) + "\n" for t in range(3))
    f.write_bytes(rows.encode("utf-16"))
    with pytest.raises(ConfigError, match=re.escape("with replay.format=jsonl: not UTF-8 text (it starts with a "
                                                    "UTF-16 LE byte-order mark; convert it: iconv -f UTF-16")):
        load_import(f, "jsonl", ImportOptions(num_experts=8))
    f.write_bytes(b"\xef\xbb\xbf" + rows.encode())  # a UTF-8 byte-order mark (Windows editors write one)
    assert load_import(f, "jsonl", ImportOptions(num_experts=8)).index.tolist() == [[0, 1], [1, 2], [2, 3]]
    c = tmp_path / "trace.csv"
    c.write_bytes(b"\xef\xbb\xbf0,0,1,2\n1,0,3,4\n")
    assert load_import(c, "llama_csv", ImportOptions(num_experts=8)).index.tolist() == [[1, 2], [3, 4]]


# ---- dense-layer placeholders, SGLang's routed_experts, llama.cpp's long CSV (issue 55) ---------------------

def _with_dense_layer(rng, tokens):
    """A [tokens, 4 decoder layers, k=2] capture of a model whose layer 0 is dense (zeros, as vLLM and SGLang
    leave it) and layers 1..3 MoE."""
    a = _vllm_arrays(rng, tokens, layers=4)
    a[:, 0] = 0
    return a


def test_vllm_dense_layer_placeholders_are_dropped_and_moe_layer_ids_kept(tmp_path):
    rng = np.random.default_rng(3)
    prompt, gen = _with_dense_layer(rng, 4), _with_dense_layer(rng, 2)
    f = tmp_path / "routes.npz"
    np.savez(f, prompt_routed_experts=prompt, routed_experts=gen)
    tr = load_import(f, "vllm", ImportOptions(num_experts=8))  # (was: "expert id 0 appears twice in one record")
    assert tr.meta.geometry.num_layers == 3 and tr.meta.geometry.layer_ids == [1, 2, 3]
    assert tr.index[0:4].tolist() == prompt[:, 1].tolist() and tr.index[8:12].tolist() == prompt[:, 3].tolist()
    assert any("layer(s) [0]" in n and "dense" in n for n in tr.notes)


def test_sglang_base64_routed_experts_with_the_models_shape(tmp_path):
    import base64

    rng = np.random.default_rng(4)
    a, b = _with_dense_layer(rng, 5), _with_dense_layer(rng, 3)
    lines = [{"text": "x", "meta_info": {"id": "r1", "prompt_tokens": 3, "completion_tokens": 3,
                                         "routed_experts": base64.b64encode(a.astype("<i4").tobytes()).decode()}},
             {"meta_info": {"id": "r2", "prompt_tokens": 2,
                            "routed_experts": base64.b64encode(b.astype("<i4").tobytes()).decode()}}]
    f = write_jsonl(tmp_path / "sglang.jsonl", lines)
    with pytest.raises(ConfigError, match="replay.model"):  # a flat array: its shape comes from the model
        load_import(f, "sglang", ImportOptions(num_experts=8))
    tr = load_import(f, "sglang", ImportOptions(num_experts=8, layers=4, top_k=2))
    # r1: a prefill of its 3 prompt tokens, then 2 decode passes; r2: a prefill of 2, then 1 decode pass
    assert tr.passes.tolist() == [[0, 3, 3], [1, 1, 4], [1, 1, 5], [0, 2, 2], [1, 1, 3]]
    assert tr.meta.geometry.layer_ids == [1, 2, 3]
    assert tr.index[0:3].tolist() == a[:3, 1].tolist() and tr.index[-1].tolist() == b[2, 3].tolist()
    # the same routing as vLLM's nested lists in the same response shape reads alike
    lines[0]["meta_info"]["routed_experts"] = a.tolist()
    lines[1]["meta_info"]["routed_experts"] = b.tolist()
    tr2 = load_import(write_jsonl(tmp_path / "lists.jsonl", lines), "sglang", ImportOptions(num_experts=8))
    assert tr2.index.tolist() == tr.index.tolist() and tr2.passes.tolist() == tr.passes.tolist()
    # what vllm said of it before: "got shape ()"; now it names the format that reads it
    f3 = write_jsonl(tmp_path / "as_vllm.jsonl", [{"routed_experts": "AAAA"}])
    with pytest.raises(ConfigError, match="replay.format=sglang"):
        load_import(f3, "vllm", ImportOptions(num_experts=8))
    pretty = tmp_path / "one.json"  # one response, pretty-printed (json.dump(..., indent=2))
    pretty.write_text(json.dumps(lines[0], indent=2))
    tr3 = load_import(pretty, "sglang", ImportOptions(num_experts=8))
    assert tr3.passes.tolist() == [[0, 3, 3], [1, 1, 4], [1, 1, 5]]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"meta_info": {"routed_experts": "AAAAAA=="}}])
    with pytest.raises(ConfigError, match=r"line 1: routed_experts of response 0 holds 4 bytes, not whole tokens"):
        load_import(bad, "sglang", ImportOptions(num_experts=8, layers=4, top_k=2))


def test_llama_long_csv_one_row_per_rank(tmp_path):
    rows = ["phase,token,layer,rank,expert"]
    want = {}
    rng = np.random.default_rng(5)
    for phase, toks in (("prefill", range(3)), ("decode", range(2))):  # decode steps numbered from 0 again
        for t in toks:
            for layer in (0, 1):
                ex = rng.choice(8, 2, replace=False).tolist()
                want[phase, t, layer] = ex
                rows += [f"{phase},{t},{layer},{r},{e}" for r, e in reversed(list(enumerate(ex)))]  # ranks unordered
    f = tmp_path / "moe.csv"
    f.write_text("\n".join(rows) + "\n")
    tr = load_import(f, "llama_csv", ImportOptions(num_experts=8))  # (was: "the header names no experts column")
    assert tr.passes.tolist() == [[0, 3, 3], [1, 1, 4], [1, 1, 5]]  # the prefill is one pass, then each decode step
    order = [("prefill", t, la) for la in (0, 1) for t in range(3)] + [("decode", t, la) for t in range(2)
                                                                        for la in (0, 1)]
    assert tr.index.tolist() == [want[c] for c in order]
    assert not any("other than" in n for n in tr.notes)  # tokens are numbered per sequence, prefill first
    gone = [r for r in rows if not r.startswith("decode,1,1,")]  # the last decode cell missing: named by the file's own token
    f.write_text("\n".join(gone) + "\n")
    with pytest.raises(ConfigError) as exc:
        load_import(f, "llama_csv", ImportOptions(num_experts=8))
    assert "1099511627" not in str(exc.value) and "layer 1" in str(exc.value)
    f.write_text("\n".join(rows[:-1]) + "\n")  # the last cell lacks its rank 0
    with pytest.raises(ConfigError, match=r"token 1 layer 1 has ranks \[1\]; each \(token, layer\) needs ranks 0..1"):
        load_import(f, "llama_csv", ImportOptions(num_experts=8))


def test_the_docs_import_commands_run_as_written_on_the_default_stack(tmp_path, mirror, monkeypatch):
    """docs/replay.md's commands on a hand-built file: the default prefetcher (topk) reads a signal no import
    has, so it falls back to prefetch=none with a note; a prefetcher the user names is refused as before."""
    from hydra import compose, initialize_config_dir

    from specmd import CONF_DIR
    from specmd.app import execute

    monkeypatch.setenv("SPECMD_DATA_MIRROR", str(mirror))
    rng = np.random.default_rng(6)
    recs = [{"seq": 0, "token": t, "layer": la, "experts": rng.choice(64, 8, replace=False).tolist()}
            for t in range(12) for la in range(4)]
    f = write_jsonl(tmp_path / "routes.jsonl", recs)
    doc = (ROOT / "docs" / "replay.md").read_text()
    assert "python -m specmd replay.trace=routes.jsonl replay.format=jsonl replay.num_experts=64 eviction=belady" in doc
    for extra, ok in (([], True), (["prefetch=topk"], False)):
        ov = [f"replay.trace={f}", "replay.format=jsonl", "replay.num_experts=64", "eviction=belady", *extra]
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="config", overrides=ov)
        run_dir = tmp_path / f"run{len(extra)}"
        if ok:
            res = execute(cfg, run_dir=str(run_dir), overrides=ov)
            assert res["config"]["prefetch"] == {"name": "none"}
            assert any("replayed with prefetch=none" in n for n in res["replay"]["notes"])
            assert res["cache"]["requests"] > 0
        else:
            with pytest.raises(ConfigError, match="prefetch=topk reads the prefetch signal"):
                execute(cfg, run_dir=str(run_dir), overrides=ov)
    # SGLang's own capture of Mixtral (32 layers, top-2 of 8), shaped by replay.model as the docs show it
    import base64

    assert "replay.trace=responses.jsonl replay.format=sglang replay.model=mixtral" in doc
    ids = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(32)]) for _ in range(6)])
    g = write_jsonl(tmp_path / "responses.jsonl", [{"meta_info": {"prompt_tokens": 4, "routed_experts":
                                                                  base64.b64encode(ids.astype("<i4").tobytes()).decode()}}])
    ov = [f"replay.trace={g}", "replay.format=sglang", "replay.model=mixtral"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=ov)
    res = execute(cfg, run_dir=str(tmp_path / "sglang_run"), overrides=ov)
    assert res["replay"]["passes"] == 3 and res["cache"]["requests"] > 0  # a prefill of 4, then 2 decode steps


@pytest.mark.parametrize("opts,words", [
    (dict(expert_bytes=2**62), "at most 1,152,921,504,606,846,976 bytes"),  # (overflowed the compiled cache's int64)
    (dict(expert_bytes=1000, model_bytes=10), "replay.model_bytes=10 is less than its routed experts'"),
])
def test_import_sizes_the_cache_cannot_account_for_are_refused(tmp_path, opts, words):
    from specmd.errors import ConfigError

    f = write_jsonl(tmp_path / "r.jsonl", canonical_records())
    with pytest.raises(ConfigError, match=words):
        load_import(f, "jsonl", ImportOptions(num_experts=8, **opts))
