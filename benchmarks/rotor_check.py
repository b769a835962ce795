"""Quick real check of rotor layers on SmolLM2-135M layer 15 (q_proj, k_proj): held-out relative MSE
of rotor / LR1 / LR4 / BH1 trained on real hidden states, and forward time against nn.Linear.

Inputs of the projections are captured with a forward hook on calibration paragraphs (Wikipedia
"calib" split) and on held-out paragraphs ("eval" split: disjoint). Every stand-in is trained with
`hf_tensorcomp.training.fit` at the `rotor` method's defaults (lr 0.05, batch 64) unless --lr /
--batch-size say otherwise (the paper's LR / BH setting is --lr 0.01 --batch-size 256). For reference, the best
rank-r map *for these activations* (reduced-rank regression, closed form from the calibration
covariance) is evaluated too. Timing: one thread, min over repeats.

    OMP_NUM_THREADS=1 python benchmarks/rotor_check.py [--calib-tokens 16384] [--eval-tokens 4096]
    OMP_NUM_THREADS=1 python benchmarks/rotor_check.py --timing-only   # forward-time table -> rotor_speed.{json,md}
    OMP_NUM_THREADS=1 python benchmarks/rotor_check.py --structures lr1 lr4 bh1 --lr 0.01 --batch-size 256 \
        --skip-timing --out rotor_check_baselines_paper_lr.json   # the baselines at the paper's LR / BH setting

Writes benchmarks/results/rotor_check.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from hf_tensorcomp.assets import load_model, load_text
from hf_tensorcomp.methods.rotor import decomposition as cl
from hf_tensorcomp.methods.rotor import RotorLinear
from hf_tensorcomp.methods.rotor.method import FIT_DEFAULTS, build, num_parameters
from hf_tensorcomp.training import fit, relative_mse

sys.path.insert(0, str(Path(__file__).parent))
from common import best_time, set_threads  # noqa: E402

LAYER = 15
RESULTS = Path(__file__).parent / "results"


@torch.no_grad()
def capture(model, tok, paragraphs, n_tokens, max_len=256):
    attn = model.model.layers[LAYER].self_attn
    rows = []
    hook = attn.q_proj.register_forward_hook(lambda m, a, o: rows.append(a[0].reshape(-1, a[0].shape[-1]).clone()))
    total = 0
    for p in paragraphs:
        ids = tok(p, return_tensors="pt", truncation=True, max_length=max_len).input_ids
        model(ids)
        total += ids.shape[1]
        if total >= n_tokens:
            break
    hook.remove()
    return torch.cat(rows)[:n_tokens]


def reduced_rank(w, x, r):
    """argmin over rank-r M of ||x Mᵀ - x Wᵀ||: (W S^{1/2})_r S^{-1/2}, S = xᵀx (ridge 1e-6 · mean eig)."""
    s = x.T @ x / x.shape[0]
    evals, evecs = torch.linalg.eigh(s.double())
    evals = evals.clamp_min(1e-6 * evals.mean())
    half, inv_half = (evecs * evals.sqrt()) @ evecs.T, (evecs / evals.sqrt()) @ evecs.T
    u, sv, vh = torch.linalg.svd(w.double() @ half)
    m = (u[:, :r] * sv[:r]) @ vh[:r] @ inv_half
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = m.float()
    return lin


class DenseChunkRotor(RotorLinear):
    """The same gadget with every window pair's sandwich precomputed as a dense 2^n x 2^n matrix (the
    authors' implementation) — only to time it against the matrix-representation application."""

    def cache_dense(self):
        with torch.no_grad():
            self._dense = []
            for i, (left, right, _, _) in enumerate(self._rotors()):
                n = self.levels[i].n
                eye = torch.eye(2**n)[None].expand(left.cos.shape[0], -1, -1)  # (pairs, 2^n basis, 2^n)
                cols = cl.sandwich(eye.transpose(1, 2), left, n, right, dim=-2)  # column j = image of e_j
                self._dense.append(cols.contiguous())

    def _maps(self, xc, i, rotors, alpha):
        lv = self.levels[i]
        mats = (self._dense[i] * alpha.reshape(-1, 1, 1)).view(lv.branches, lv.m_in, lv.m_out, lv.chunk, lv.chunk)
        return (mats @ xc[None, :, None]).sum(1)


class VectorProductRotor(RotorLinear):
    """The previous application: each simple rotor as two vector products (n signed bit-flipped
    copies each) on every window pair — kept to time against."""

    def _maps(self, xc, i, rotors, alpha):
        lv = self.levels[i]
        left, right, _, _ = rotors
        xp = xc[None, :, None].expand(lv.branches, lv.m_in, lv.m_out, lv.chunk, xc.shape[-1]).reshape(-1, lv.chunk, xc.shape[-1])
        y = cl.sandwich(xp, left, lv.n, right, dim=-2) * alpha.reshape(-1, 1, 1)
        return y.view(lv.branches, lv.m_in, lv.m_out, lv.chunk, -1).sum(1)


IMPLEMENTATIONS = {
    "nn.Linear": None,
    "rotor: matrix representation (current)": RotorLinear,
    "rotor: vector products (previous application)": VectorProductRotor,
    "rotor: dense 2^n x 2^n chunk matrices (the authors')": DenseChunkRotor,
}


def speed_table(x: torch.Tensor, rounds: int = 5) -> list[dict]:
    """Forward ms (one thread, min over `rounds`) of each implementation of the same random-init gadget
    for SmolLM2's q (576 -> 576) and k/v (576 -> 192) at batch 1 and 64, outputs checked equal."""
    rows = []
    with torch.no_grad():
        for name, d_out in (("q_proj 576->576", 576), ("k_proj 576->192", 192)):
            mods = {}
            for label, cls in IMPLEMENTATIONS.items():
                mods[label] = nn.Linear(576, d_out).eval() if cls is None else cls.create(576, d_out).eval()
                if cls is DenseChunkRotor:
                    mods[label].cache_dense()
            ref = mods["rotor: matrix representation (current)"]
            for b in (1, 64):
                xb = x[:b].contiguous()
                t_lin = best_time(lambda: mods["nn.Linear"](xb), 200 if b == 1 else 50, rounds)
                for label, m in mods.items():
                    if label != "nn.Linear":
                        assert torch.allclose(m(xb), ref(xb), atol=1e-4), label
                    t = t_lin if label == "nn.Linear" else best_time(lambda: m(xb), 20 if b == 1 else 5, rounds)
                    rows.append({"projection": name, "batch": b, "implementation": label, "ms": round(t * 1e3, 4),
                                 "vs_linear": round(t / t_lin, 1)})
                    print(rows[-1], flush=True)
    return rows


def speed_markdown(rows: list[dict]) -> str:
    lines = ["| projection | implementation | batch 1 ms | × Linear | batch 64 ms | × Linear |", "|---|---|---|---|---|---|"]
    for proj in dict.fromkeys(r["projection"] for r in rows):
        for impl in dict.fromkeys(r["implementation"] for r in rows):
            b1, b64 = (next(r for r in rows if r["projection"] == proj and r["implementation"] == impl and r["batch"] == b)
                       for b in (1, 64))
            lines.append(f"| {proj} | {impl} | {b1['ms']:.3f} | {b1['vs_linear']} | {b64['ms']:.3f} | {b64['vs_linear']} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--structures", nargs="+", default=["rotor", "rotor-pad", "lr1", "lr4", "bh1"])
    ap.add_argument("--projections", nargs="+", default=["q_proj", "k_proj"])
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--timing-only", action="store_true", help="only the forward-time table -> rotor_speed.{json,md}")
    ap.add_argument("--lr", type=float, help="override every structure's learning rate (default: the paper's per structure)")
    ap.add_argument("--batch-size", type=int, help="override every structure's batch size")
    ap.add_argument("--out", default="rotor_check.json")
    args = ap.parse_args()
    set_threads(1)
    model, tok = load_model("smollm2")
    if args.timing_only:
        x = capture(model, tok, load_text("wikipedia", "eval"), 64)
        timing = speed_table(x)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "rotor_speed.json").write_text(json.dumps(timing, indent=1))
        (RESULTS / "rotor_speed.md").write_text(speed_markdown(timing))
        print(speed_markdown(timing))
        return
    x_cal = capture(model, tok, load_text("wikipedia", "calib"), args.calib_tokens)
    x_ev = capture(model, tok, load_text("wikipedia", "eval"), args.eval_tokens)
    print(f"calibration tokens {x_cal.shape[0]}, held-out tokens {x_ev.shape[0]}", flush=True)
    attn = model.model.layers[LAYER].self_attn
    out = {"layer": LAYER, "calib_tokens": x_cal.shape[0], "eval_tokens": x_ev.shape[0], "fits": [], "timing": {}}
    base = {"chunk": None, "chunking": "wrap", "depth": 2, "width": 3, "double": True, "iters": 50, "grad_steps": 1,
            "blocks": 64, "seed": 0}
    for proj in args.projections:
        lin = getattr(attn, proj)
        for r in (1, 4):
            ref = reduced_rank(lin.weight.detach(), x_cal, r)
            row = {"projection": proj, "structure": f"optimal rank {r} (closed form)", "params": r * (lin.in_features + lin.out_features),
                   "heldout_rel_mse": round(relative_mse(ref, lin, x_ev), 4), "calib_rel_mse": round(relative_mse(ref, lin, x_cal), 4)}
            out["fits"].append(row)
            print(row, flush=True)
        for name in args.structures:
            structure, opts = name, dict(base)
            if name == "rotor-pad":
                structure, opts["chunking"] = "rotor", "pad"
            lr, bs = FIT_DEFAULTS[structure]
            lr, bs = args.lr or lr, args.batch_size or bs
            m = build(structure, lin.in_features, lin.out_features, opts)
            t0 = time.perf_counter()
            hist = fit(m, lin, x_cal, lr=lr, batch_size=bs, seed=0)
            secs = time.perf_counter() - t0
            row = {"projection": proj, "structure": name, "params": num_parameters(m), "lr": lr, "batch_size": bs,
                   "steps": len(hist), "train_seconds": round(secs, 1),
                   "calib_rel_mse": round(relative_mse(m, lin, x_cal), 4), "heldout_rel_mse": round(relative_mse(m, lin, x_ev), 4),
                   "loss_first_last": [round(hist[0], 4), round(hist[-1], 4)]}
            out["fits"].append(row)
            print(row, flush=True)
    if not args.skip_timing:
        out["timing"] = speed_table(x_ev[:64].contiguous())
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
