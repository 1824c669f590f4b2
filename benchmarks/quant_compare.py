"""Which library quantizes experts best: HQQ (with and without its half-quadratic refinement) against
optimum-quanto, on the embedded model's real expert weights. Prints the relative Frobenius error of the
dequantized weights and of the expert outputs on real hidden states, and the quantization time.

    python benchmarks/quant_compare.py
"""

import time

import torch

from specmd.models.loader import ModelConfig, load_model
from specmd.cli import script


def group(w):
    """64 weights per scale where the input dimension allows it, else one group per row (specmd's rule)."""
    return 64 if w.shape[-1] % 64 == 0 else w.shape[-1]


def hqq(w, bits, optimize):
    from hqq.core.quantize import Quantizer

    wq, meta = Quantizer.quantize(w, nbits=bits, group_size=group(w), optimize=optimize, axis=1, bitpack=True,
                                  compute_dtype=torch.float32, device="cpu")
    return Quantizer.dequantize(wq, meta).reshape(w.shape)


def quanto(w, bits, optimize):
    from optimum.quanto import qint2, qint4, qint8, quantize_weight
    from optimum.quanto.tensor.optimizers import AbsmaxOptimizer, MaxOptimizer

    q = {8: qint8, 4: qint4, 2: qint2}[bits]
    if bits == 8:
        return quantize_weight(w, qtype=q, axis=0, scale=AbsmaxOptimizer()(w, qtype=q, axis=0)).dequantize()
    scale, shift = MaxOptimizer()(w, qtype=q, axis=0, group_size=group(w))
    return quantize_weight(w, qtype=q, axis=0, scale=scale, shift=shift, group_size=group(w)).dequantize()


def main(argv: list) -> int:
    script.ArgumentParser(description=__doc__).parse_args(argv)  # --help; no options
    torch.manual_seed(0)
    model, tok = load_model(ModelConfig(family="olmoe", pretrained="specmd:tiny-olmoe"))
    layer = model.model.layers[1].mlp.experts
    gate_up, down = layer.gate_up_proj.detach(), layer.down_proj.detach()  # [E, 2I, H], [E, H, I]
    ids = tok("The game began development in 2010, carrying over a large portion of the work", return_tensors="pt")
    captured = {}
    h = model.model.layers[1].mlp.register_forward_pre_hook(lambda m, a: captured.setdefault("x", a[0]))
    with torch.no_grad():
        model(**ids)
    h.remove()
    x = captured["x"].reshape(-1, gate_up.shape[-1])

    def expert_out(gu, dn):
        g, u = (x @ gu.transpose(-1, -2)).chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * u) @ dn.transpose(-1, -2)

    ref = expert_out(gate_up, down)
    print(f"{'library':<18} {'bits':>4} {'weight rel err':>15} {'output rel err':>15} {'time s':>8}")
    for name, fn, opt in (("hqq (optimize)", hqq, True), ("hqq", hqq, False), ("optimum-quanto", quanto, None)):
        for bits in (8, 4, 2):
            fn(gate_up[0].float(), bits, opt)  # warm-up (quanto builds kernels on first use)
            t = time.perf_counter()
            gu = torch.stack([fn(gate_up[e].float(), bits, opt) for e in range(gate_up.shape[0])])
            dn = torch.stack([fn(down[e].float(), bits, opt) for e in range(down.shape[0])])
            dt = time.perf_counter() - t
            werr = float(torch.cat([(gu - gate_up).flatten(), (dn - down).flatten()]).norm()
                         / torch.cat([gate_up.flatten(), down.flatten()]).norm())
            oerr = float((expert_out(gu, dn) - ref).norm() / ref.norm())
            print(f"{name:<18} {bits:>4} {werr:>15.4f} {oerr:>15.4f} {dt:>8.2f}")
    return 0


if __name__ == "__main__":
    script.run("benchmarks/quant_compare.py", main)
