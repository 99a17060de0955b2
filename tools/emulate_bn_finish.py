"""A host emulation of batch_norm_relu's training statistics on a channels-last batch
(bn_stats_rows' fp32 partial sums in their order, then bn_finish in fp32 as at
0697ff5, or in double as now), against an fp64 reference: the output's largest error.
The input is test_ops' test_gpu_batch_norm_relu_matches_fp64 case that failed on the
H100 at 0697ff5 (fp32, (8, 24, 7, 9) channels-last, training: 2.18e-6 against a 2.0e-6
limit). The emulation does not model FMA contraction or rsqrtf, so it gives the size
of the effect, not the GPU's digits.

    python3 tools/emulate_bn_finish.py    # fp32 finish 3.4e-06, double finish 1.3e-06
"""
import torch, numpy as np
f32 = np.float32
g = torch.Generator().manual_seed(13)
shapes = [((7, 3), 0), ((64, 4, 4, 4), 0), ((4, 5, 1023), 0), ((16, 64, 14, 14), 0), ((2, 3, 1, 1), 0),
          ((256, 32, 9, 9), 0), ((3, 8, 32, 32), 0), ((37, 8, 48, 48), 0), ((16, 64, 14, 14), 1),
          ((8, 24, 7, 9), 1)]
def _t(shape, shift=0.0): return torch.randn(shape, generator=g, dtype=torch.float64) + shift
for shape, cl in shapes:
    c = shape[1]
    x = _t(shape, 1.5).float(); w = _t((c,)).float(); b = _t((c,)).float(); rm = _t((c,)).float(); rv = _t((c,)).float().abs() + 0.5
    go = torch.randn(shape, generator=g, dtype=torch.float64)
X = x.permute(0, 2, 3, 1).reshape(-1, c).numpy().astype(f32)   # rows (R, C)
R = X.shape[0]; W = w.numpy(); B = b.numpy()
splits = min(1024, (R + 63) // 64); per = -(-R // splits)
def emulate(double_finish):
    out = np.empty_like(X)
    for ch in range(c):
        shift = X[0, ch]
        parts = []
        for k in range(splits):
            r0, r1 = k * per, min(k * per + per, R)
            ss, ss2 = [], []
            for ty in range(8):
                s = f32(0); s2 = f32(0)
                for r in range(r0 + ty, r1, 8):
                    d = f32(X[r, ch] - shift); s = f32(s + d); s2 = f32(s2 + f32(d * d))
                ss.append(s); ss2.append(s2)
            s, s2 = ss[0], ss2[0]
            for ty in range(1, 8): s = f32(s + ss[ty]); s2 = f32(s2 + ss2[ty])
            parts.append((s, s2))
        if double_finish:
            a = sum(float(p[0]) for p in parts); bb = sum(float(p[1]) for p in parts)
            m = a / R; var = max(bb / R - m * m, 0.0)
            mu = f32(float(shift) + m); inv = f32(1.0 / np.sqrt(var + 1e-5))
        else:
            # butterfly over 32 lanes (8 used)
            vals = [parts[i] if i < splits else (f32(0), f32(0)) for i in range(32)]
            for o in (16, 8, 4, 2, 1):
                vals = [(f32(vals[i][0] + vals[i ^ o][0]), f32(vals[i][1] + vals[i ^ o][1])) for i in range(32)]
            a, bb = vals[0]
            m = f32(a / f32(R)); var = max(f32(f32(bb / f32(R)) - f32(m * m)), f32(0))
            mu = f32(shift + m); inv = f32(1.0 / np.sqrt(np.float64(f32(var + f32(1e-5)))))
        sc = f32(inv * W[ch]); sh = B[ch]
        out[:, ch] = np.maximum(f32(f32(X[:, ch] - mu) * sc) + sh, 0)
    return out
X64 = X.astype(np.float64)
mean = X64.mean(0); var = X64.var(0)
ref = np.maximum((X64 - mean) / np.sqrt(var + 1e-5) * W.astype(np.float64) + B.astype(np.float64), 0)
for df in (False, True):
    print("double finish" if df else "fp32 finish", np.abs(emulate(df).astype(np.float64) - ref).max())
