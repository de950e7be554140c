"""Would int8 activations (W8A8) pay on this CPU? Quality and speed of linear layers that
quantize their input to 8 bits per call and multiply in integers (torch's fbgemm kernel,
`torch.ops.quantized.linear_dynamic`), against the float32 model tierserve runs on a CPU
without bfloat16 matmul (AVX2), side by side in one process.

    python benchmarks/w8a8_probe.py [--docs 12] [--threads 2]

Not a format tierserve serves: a probe, kept so the measurement behind the decision can be
repeated (docs/benchmarks.md). Variants, each over every linear layer unless it says not:
- per-call: torch's own dynamic quantization (`quantize_dynamic` does this): int8 weights
  per output row, the input rounded with one range for the whole call in 7 bits (x86's
  u8 x s8 multiply sums pairs in 16 bits and would overflow at 8).
- per-row: every input row scaled to the same range before the call and the output row
  scaled back (a linear layer is linear per row, so this is per-row rounding in one call),
  7-bit weights so the input keeps 8 bits without overflow.
- +smooth: SmoothQuant's channel scales (alpha 0.5) from activation ranges measured on
  documents kept apart from the scored ones, moved from the input into the weight.
- lm_head, down_proj float: the two most sensitive layers left in float32 (packed).
Quality: mean KL and top-1 agreement against the float32 model, teacher-forced
(quant_quality.py's documents and forward). Speed: best of 5 forwards over 16 and 64
tokens and of 2 over 512 (logits for every token), against float32 packed by oneDNN.
"""

import argparse
import copy
import platform
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_quality  # noqa: E402  (documents, logits)


class W8A8Linear(nn.Module):
    def __init__(self, weight, bias, per_row: bool, smooth=None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float() * (1 if smooth is None else smooth)
        qmax = 63 if per_row else 127
        scales = (w.abs().amax(dim=1) / qmax).clamp(min=1e-12)
        codes = torch.quantize_per_channel(w, scales.double(), torch.zeros_like(
            scales, dtype=torch.long), 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(codes, None)
        self.bias, self.per_row = bias, per_row
        self.inv_smooth = None if smooth is None else 1 / smooth

    def forward(self, x):
        x2 = x.reshape(-1, self.in_features)
        if self.inv_smooth is not None:
            x2 = x2 * self.inv_smooth
        if self.per_row:
            r = x2.abs().amax(1, keepdim=True).clamp(min=1e-12)
            y = torch.ops.quantized.linear_dynamic((x2 / r).contiguous(), self.packed, False) * r
        else:
            y = torch.ops.quantized.linear_dynamic(x2.contiguous(), self.packed, True)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def input_ranges(model, docs) -> dict:
    """Largest |input| per channel of every linear layer, by layer name."""
    ranges, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            def hook(m, inp, out, name=name):
                a = inp[0].reshape(-1, inp[0].shape[-1]).abs().amax(0)
                ranges[name] = torch.maximum(ranges.get(name, a), a)
            hooks.append(mod.register_forward_hook(hook))
    for tokens in docs:
        quant_quality.logits(model, tokens)
    for h in hooks:
        h.remove()
    return ranges


def variant(ref, per_row: bool, ranges=None, keep=()):
    m = copy.deepcopy(ref)
    for name, mod in list(ref.named_modules()):
        if not isinstance(mod, nn.Linear) or name.rsplit(".", 1)[-1] in keep:
            continue
        smooth = None
        if ranges is not None:
            sx, sw = ranges[name].clamp(min=1e-5), mod.weight.abs().amax(0).clamp(min=1e-5)
            smooth = (sx.sqrt() / sw.sqrt()).clamp(min=1e-5)
        parent, _, attr = name.rpartition(".")
        setattr(m.get_submodule(parent) if parent else m, attr,
                W8A8Linear(mod.weight, mod.bias, per_row, smooth))
    return m


def forward_ms(model, tokens, repeats) -> float:
    quant_quality.logits(model, tokens)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        quant_quality.logits(model, tokens)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=12, help="documents scored (4 more calibrate)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tierserve.config import ModelConfig
    from tierserve.model.cpu_linear import pack_linears
    from tierserve.model.loader import load_model
    from tierserve.model.tokenizer import Tokenizer

    loaded = load_model(ModelConfig(dtype="float32"), 512)
    ref = loaded.model
    docs = quant_quality.documents(Tokenizer.load(loaded.tokenizer_source), 512)
    scored, calib = docs[:min(args.docs, len(docs) - 4)], docs[-4:]
    ranges = input_ranges(ref, calib)
    variants = {
        "per-call (torch quantize_dynamic)": variant(ref, False),
        "per-row": variant(ref, True),
        "per-row +smooth": variant(ref, True, ranges),
        "per-row +smooth, lm_head down_proj float": variant(ref, True, ranges,
                                                            ("lm_head", "down_proj")),
    }
    for m in variants.values():
        pack_linears(m)          # the float layers left, as ModelRunner packs them
    kl = dict.fromkeys(variants, 0.0)
    top1 = dict.fromkeys(variants, 0)
    count = 0
    for tokens in scored:
        ref_lp = torch.log_softmax(quant_quality.logits(ref, tokens), -1)
        for name, m in variants.items():
            lp = torch.log_softmax(quant_quality.logits(m, tokens), -1)
            kl[name] += (ref_lp.exp() * (ref_lp - lp)).sum().item()
            top1[name] += (lp.argmax(-1) == ref_lp.argmax(-1)).sum().item()
        count += len(tokens)
    pack_linears(ref)
    long = (docs[0] * 8)[:512]
    base = {n: forward_ms(ref, long[:n], 5 if n < 512 else 2) for n in (16, 64, 512)}
    print(f"# w8a8_probe model={loaded.source} reference=float32 tokens={count} "
          f"threads={args.threads} torch={torch.__version__} cpu={platform.machine()} "
          f"float32_packed_ms 16/64/512={base[16]:.1f}/{base[64]:.1f}/{base[512]:.1f}")
    for name, m in variants.items():
        gain = "/".join(f"{base[n] / forward_ms(m, long[:n], 5 if n < 512 else 2):.2f}x"
                        for n in (16, 64, 512))
        print(f"variant={name:<42} mean_kl={kl[name] / count:.5f} "
              f"top1_agreement={top1[name] / count:.4f} speed_vs_float32 16/64/512={gain}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
