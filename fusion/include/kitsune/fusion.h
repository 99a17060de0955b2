/* kitsune/fusion.h — C launchers of Kitsune's fused CUDA kernels.
 *
 * Each launcher checks its own preconditions, launches on the stream it is given
 * (a cudaStream_t; NULL is the legacy default stream) and returns a kt_status:
 * KT_ERR_INVALID for a bad argument (NULL pointer, negative size, unknown dtype),
 * KT_ERR_UNAVAILABLE without a CUDA device, KT_ERR_BACKEND when the launch fails.
 * With no work (zero rows or elements) a tensor's pointer may be NULL (an empty
 * tensor's is): nothing is launched, and an output that still has values (a mean over
 * nothing: NaN) is written.
 * Tensors are dense and contiguous; n counts elements. Arithmetic is done in fp32
 * whatever the storage type, and every output element is rounded once.
 * The kernels are compiled for sm_80 and sm_90 with PTX for newer GPUs
 * (fusion/kernels/, one concept per .cu file).
 */
#ifndef KITSUNE_FUSION_H
#define KITSUNE_FUSION_H

#include <stdint.h>

#include "kitsune/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kt_dtype { KT_F32 = 0, KT_F16 = 1, KT_BF16 = 2 } kt_dtype;

/* out = relu(a + b) */
kt_status kt_add_relu(kt_dtype t, const void *a, const void *b, void *out, int64_t n, void *stream);
/* grad_in = grad where out > 0, else 0 (the gradient for both a and b) */
kt_status kt_add_relu_backward(kt_dtype t, const void *grad, const void *out, void *grad_in, int64_t n,
                               void *stream);

/* out = tanh(a * b) */
kt_status kt_mul_tanh(kt_dtype t, const void *a, const void *b, void *out, int64_t n, void *stream);
/* d = grad * (1 - tanh(a*b)^2), tanh recomputed in fp32; grad_a = d * b; grad_b = d * a */
kt_status kt_mul_tanh_backward(kt_dtype t, const void *grad, const void *a, const void *b, void *grad_a,
                               void *grad_b, int64_t n, void *stream);

/* out[i] = gelu(x[i] + bias[i % nbias]); approximate 0 = exact (erf), 1 = tanh (the
 * backward, with the bias gradient: kt_bias_gelu_grad_colsum) */
kt_status kt_bias_gelu(kt_dtype t, const void *x, const void *bias, void *out, int64_t n, int64_t nbias,
                       int approximate, void *stream);
/* out[i] = x[i] + bias[i % nbias], relu'd when relu = 1 (NaN stays NaN, as torch.relu
 * keeps it); n a multiple of nbias. */
kt_status kt_bias_act(kt_dtype t, const void *x, const void *bias, void *out, int64_t n, int64_t nbias, int relu,
                      void *stream);
/* out = max_pool2d(relu(y + bias[c]), (kh, kw)) over non-overlapping windows (stride =
 * kernel, no padding, floor mode): y (n, c, h, w) contiguous, out (n, c, h / kh, w / kw);
 * h >= kh, w >= kw. The values compared are relu(y + bias) rounded to the storage type;
 * ties go to the first in row-major window order and a NaN wins, as in torch's
 * max_pool2d(relu(y + bias)). */
kt_status kt_bias_relu_pool(kt_dtype t, const void *y, const void *bias, void *out, int64_t n, int64_t c, int64_t h,
                            int64_t w, int kh, int kw, void *stream);
/* Its backward: gy (n, c, h, w) = grad_out at each window's winner where the window's
 * value is not <= 0, 0 everywhere else; plane_sums (n * c fp32) = gy summed over each
 * (n, c) plane in a fixed order (the bias gradient is their sum over n). */
kt_status kt_bias_relu_pool_backward(kt_dtype t, const void *grad_out, const void *y, const void *bias, void *gy,
                                     float *plane_sums, int64_t n, int64_t c, int64_t h, int64_t w, int kh, int kw,
                                     void *stream);
/* 2-D max pooling, dilation 1: input (n, c, h, w), output (n, c, oh, ow), windows kh x kw
 * (kh * kw <= 256) at strides (sh, sw) with padding (ph, pw) <= half the window, every
 * window holding an input element; channels_last 0 = both NCHW-contiguous, 1 = NHWC. */
typedef struct kt_pool2d {
  int64_t n, c, h, w, oh, ow;
  int kh, kw, sh, sw, ph, pw, channels_last;
} kt_pool2d;
/* out = the window maxima, as ATen's max_pool2d takes them (a NaN wins, the last one
 * among several; ties go to the first in row-major window order); where (uint8, out's
 * shape and layout) = the winner's offset a * kw + b in its window. */
kt_status kt_max_pool2d(kt_dtype t, const void *x, void *out, uint8_t *where, const kt_pool2d *p, void *stream);
/* grad_in = the sum over the windows an input element won of their output gradients,
 * in fp32, window rows then columns in order; 0 for elements that won none. */
kt_status kt_max_pool2d_backward(kt_dtype t, const void *grad_out, const uint8_t *where, void *grad_in,
                                 const kt_pool2d *p, void *stream);
/* The same plus up to KT_POOL_ADDENDS tensors of grad_in's shape, layout and dtype (the
 * other gradients of the pooled tensor: an Inception block's branches beside its pooling),
 * added in fp32 after the windows' sums, in order, and rounded once: one pass where
 * autograd would add them one launch each. grad_out NULL: no pooling gradient (the sum
 * of the addends alone). adds->n in 0..KT_POOL_ADDENDS, its first n pointers non-NULL. */
#define KT_POOL_ADDENDS 4
typedef struct kt_addends {
  const void *p[KT_POOL_ADDENDS];
  int n;
} kt_addends;
kt_status kt_max_pool2d_backward_add(kt_dtype t, const void *grad_out, const uint8_t *where, const kt_addends *adds,
                                     void *grad_in, const kt_pool2d *p, void *stream);
/* Global average pooling of a channels-last x (n, c, h, w), NHWC in memory, hw = h * w > 0:
 * out (n, c) dense = each (image, channel)'s pixels summed in fp32 in a fixed order
 * (independent of timing), times 1 / hw, rounded once. n * c = 0 does nothing. */
kt_status kt_global_avg_pool(kt_dtype t, const void *x, void *out, int64_t n, int64_t c, int64_t hw, void *stream);
/* Its backward: grad_in (n, c, h, w) NHWC-dense = grad[i, j] * (1 / hw) at every pixel,
 * rounded once; grad (n, c) dense. */
kt_status kt_global_avg_pool_backward(kt_dtype t, const void *grad, void *grad_in, int64_t n, int64_t c, int64_t hw,
                                      void *stream);
/* The weight gradient of an embedding lookup: grad_weight (rows, dim) dense = for each
 * row v, the sum of the grad rows (n, dim dense) whose indices[p] == v, in fp32 in
 * ascending p and rounded once; zero for rows no index names and for padding_idx (-1:
 * none); indices outside [0, rows) add nothing. workspace: kt_embedding_backward_workspace
 * bytes on the device, 256-byte aligned (-1 there: n or rows out of range). */
int64_t kt_embedding_backward_workspace(int64_t n, int64_t rows);
kt_status kt_embedding_backward(kt_dtype t, const void *grad, const int64_t *indices, int64_t n, int64_t dim,
                                int64_t rows, int64_t padding_idx, void *grad_weight, void *workspace,
                                int64_t workspace_bytes, void *stream);
/* kitsune.bias_cat: parts i < k of (n, c[i], h, w), all NCHW-contiguous (channels_last =
 * 0) or all channels-last (1), concatenated over dim 1 at channel offsets off[i]
 * (off[0] = 0, off[i + 1] = off[i] + c[i]; off[k] = the total). */
#define KT_CAT_MAX 8
typedef struct kt_cat_parts {
  int k;
  void *data[KT_CAT_MAX];       /* the parts: read by the forward, written by the backward */
  const void *bias[KT_CAT_MAX]; /* c[i] elements each (the forward's) */
  int64_t c[KT_CAT_MAX], off[KT_CAT_MAX + 1];
  int64_t n, h, w;
  int channels_last;
} kt_cat_parts;
/* out (n, off[k], h, w), the parts' layout: out[:, off[i] + j] = data[i][:, j] + bias[i][j]. */
kt_status kt_bias_cat(kt_dtype t, const kt_cat_parts *parts, void *out, void *stream);
/* The backward: data[i] (dense, the parts' layout) = grad[:, off[i] : off[i] + c[i]], where
 * grad (n, off[k], h, w) has element strides grad_strides (any, broadcast ones too); and
 * partial = fp32 partial sums of grad over n, h, w: (kt_bias_cat_partials(parts), off[k]),
 * whose column sums (kt_colsum) are the bias gradients. kt_bias_cat_partials is -1 for
 * invalid parts. */
kt_status kt_bias_cat_backward(kt_dtype t, const void *grad, const int64_t grad_strides[4],
                               const kt_cat_parts *parts, float *partial, void *stream);
int64_t kt_bias_cat_partials(const kt_cat_parts *parts);
/* out = silu(gate) * up */
kt_status kt_swiglu(kt_dtype t, const void *gate, const void *up, void *out, int64_t n, void *stream);
/* grad_gate = grad * up * silu'(gate); grad_up = grad * silu(gate) */
kt_status kt_swiglu_backward(kt_dtype t, const void *grad, const void *gate, const void *up, void *grad_gate,
                             void *grad_up, int64_t n, void *stream);

/* Row-wise, over `rows` rows of n contiguous elements:
 * y = x * rsqrt(mean(x^2) + eps) * weight (weight has n elements). */
kt_status kt_rms_norm(kt_dtype t, const void *x, const void *weight, void *y, int64_t rows, int64_t n, float eps,
                      void *stream);
/* grad_x = r * weight * grad - x * r^3 / n * sum(grad * weight * x), r = rsqrt(mean(x^2) + eps),
 * recomputed per row; rstd (rows fp32 values, may be NULL) receives r for the weight's gradient
 * sum over rows of grad * x * r. */
kt_status kt_rms_norm_backward(kt_dtype t, const void *grad, const void *x, const void *weight, void *grad_x,
                               float *rstd, int64_t rows, int64_t n, float eps, void *stream);

/* LayerNorm over the last dimension of `rows` rows of n elements, with an optional
 * residual added first and an optional ReLU after:
 *   h = x + residual (residual may be NULL: h = x); sum_out (may be NULL; needs a
 *   residual) receives h, rounded to the storage type as the statistics see it;
 *   y = (h - mean(h)) * rsqrt(var(h) + eps) * weight + bias, then max(y, 0) if relu.
 * weight and bias (n elements) may each be NULL (1 and 0). fp32 statistics. */
kt_status kt_layer_norm(kt_dtype t, const void *x, const void *residual, const void *weight, const void *bias,
                        void *sum_out, void *y, int64_t rows, int64_t n, float eps, int relu, void *stream);
/* Backward of kt_layer_norm with respect to h (x and residual share it):
 *   grad_h = rstd * (dy - mean(dy) - xhat * mean(dy * xhat)) + grad_h_in,
 *   dy = grad * weight (zero where y <= 0 when relu), statistics recomputed from h.
 * grad_h_in (the gradient reaching sum_out; may be NULL) is added. mean and rstd
 * (rows fp32 each) receive the row statistics. partial_w / partial_b (may be NULL;
 * splits rows of n fp32, partial_ld >= n apart) receive per-stripe sums of
 * dy/w * xhat and dy/w over `splits` stripes of rows: the weight and bias gradients
 * are their sums over stripes. kt_layer_norm_backward_splits gives a good stripe
 * count for the kernel that runs at (t, rows, n). */
kt_status kt_layer_norm_backward(kt_dtype t, const void *grad, const void *grad_h_in, const void *h,
                                 const void *weight, const void *bias, void *grad_h, float *mean, float *rstd,
                                 float *partial_w, float *partial_b, int64_t partial_ld, int64_t splits, int64_t rows,
                                 int64_t n, float eps, int relu, void *stream);
int64_t kt_layer_norm_backward_splits(kt_dtype t, int64_t rows, int64_t n);
/* Stripes for kt_layer_norm_param_grads. */
int64_t kt_layer_norm_param_splits(int64_t rows, int64_t n);
/* The weight/bias gradient part alone: partial_w/partial_b[stripe, col] = sums over a
 * stripe of rows of g * (h - mean) * rstd and g, from per-row fp32 mean and rstd;
 * mean may be NULL for 0 (RMSNorm's weight gradient). */
kt_status kt_layer_norm_param_grads(kt_dtype t, const void *grad, const void *h, const float *mean, const float *rstd,
                                    float *partial_w, float *partial_b, int64_t splits, int64_t rows, int64_t n,
                                    void *stream);

/* Softmax cross-entropy over `rows` rows of C logits (row i at logits + i * ld,
 * ld >= C: a padded row stride keeps GEMM outputs aligned), the softmax never stored.
 * target: rows int64 class indices. With lse = log(sum_j exp(x_j)) and
 * q = (1 - label_smoothing) * onehot(target) + label_smoothing / C:
 *   loss[row] = -sum_j q_j * log softmax_j (fp32; may be NULL)
 *   grad[row, j] (same row stride ld) = scale * (softmax_j - q_j), scale = *grad_scale (fp32 on the
 *   device; NULL means 1); grad may be NULL, or equal to logits (written in place),
 *   or any buffer with the same alignment modulo 16 bytes.
 * A row whose target is ignore_index has loss 0 and gradient 0; a target outside
 * [0, C) otherwise gives NaN loss and gradient (no host sync to report it). */
kt_status kt_cross_entropy(kt_dtype t, const void *logits, const int64_t *target, float *loss, void *grad,
                           const float *grad_scale, int64_t rows, int64_t C, int64_t ld, int64_t ignore_index,
                           float label_smoothing, void *stream);
/* The mean over the rows whose target is not ignore_index, in one block:
 *   kt_cross_entropy_mean:  *out (type t) = sum(loss[0..rows)) / count
 *   kt_cross_entropy_scale: *scale (fp32) = *grad (type t; NULL means 1) / count
 * A count of 0 gives NaN (0 / 0), as PyTorch's mean reduction does. */
kt_status kt_cross_entropy_mean(kt_dtype t, const float *loss, const int64_t *target, int64_t rows,
                                int64_t ignore_index, void *out, void *stream);
kt_status kt_cross_entropy_scale(kt_dtype t, const void *grad, const int64_t *target, int64_t rows,
                                 int64_t ignore_index, float *scale, void *stream);
/* grad[0..n) *= *by (fp32 on the device), in place, unless *by == 1, when nothing is
 * read or written: the backward of a cross-entropy whose gradient the forward formed
 * for an incoming gradient of 1 (kt_cross_entropy with loss and grad both given). */
kt_status kt_cross_entropy_rescale(kt_dtype t, void *grad, int64_t n, const float *by, void *stream);

/* 1 when node (a cudaGraphNode_t of a captured graph) is a kernel of Kitsune's
 * programmatic dependent launches (column sums, LayerNorm's warp backward), which
 * wait for the kernel before them ahead of any global memory access; else 0. A
 * programmatic edge into such a node orders memory as a plain edge does: capture
 * plans count it. */
int kt_graph_node_waits_first(const void *node);

/* Row reductions over the last dimension of a [rows, n] view (rows = 1 for a full
 * reduction), fp32 accumulation, one rounding to the storage type:
 *   KT_REDUCE_SUM_SQUARED: out[r] = sum_i x[r, i]^2
 *   KT_REDUCE_MEAN_ABS:    out[r] = sum_i |x[r, i]| / n
 * workspace: kt_reduce_workspace(rows, n) fp32 values on the device (NULL when 0). */
enum { KT_REDUCE_SUM_SQUARED = 0, KT_REDUCE_MEAN_ABS = 1 };
kt_status kt_reduce(kt_dtype t, int op, const void *x, void *out, float *workspace, int64_t rows, int64_t n,
                    void *stream);
int64_t kt_reduce_workspace(int64_t rows, int64_t n);

/* Column sums of a row-major [rows, cols] matrix whose rows are ld >= cols elements
 * apart: out[j] = sum_i x[i * ld + j] (rows = 0 gives zeros). fp32 accumulation in
 * an order fixed by the shape (deterministic); out is stored as t, or as fp32 when
 * out_f32 = 1. workspace: kt_colsum_workspace(t, rows, cols) fp32 values on the
 * device (NULL when 0). */
kt_status kt_colsum(kt_dtype t, int out_f32, const void *x, void *out, float *workspace, int64_t rows, int64_t cols,
                    int64_t ld, void *stream);
/* The same with the sums stored as out_t: t, KT_F32, or, for fp32 x, KT_F16 / KT_BF16
 * (rounded once from the fp32 sum: a LayerNorm's fp32 parameter partials to bf16
 * parameter gradients without a cast kernel). */
kt_status kt_colsum_to(kt_dtype t, kt_dtype out_t, const void *x, void *out, float *workspace, int64_t rows,
                       int64_t cols, int64_t ld, void *stream);
int64_t kt_colsum_workspace(kt_dtype t, int64_t rows, int64_t cols);
/* ReLU's backward and the bias gradient in one pass over contiguous (rows, cols)
 * matrices: grad_in = y > 0 ? grad : 0 (y is ReLU's output; NaN gives 0, as
 * kt_add_relu_backward), out[j] = the column sums of grad_in as kt_colsum sums them
 * (same workspace, kt_colsum_workspace). */
kt_status kt_relu_grad_colsum(kt_dtype t, int out_f32, const void *grad, const void *y, void *grad_in, void *out,
                              float *workspace, int64_t rows, int64_t cols, void *stream);
/* GELU's backward and the bias gradient in one pass over contiguous (rows, cols)
 * matrices: grad_in = grad * gelu'(x + bias[j]) (approximate as in kt_bias_gelu; bias
 * may be NULL for x that already holds it, e.g. a GEMM epilogue's pre-activation),
 * out[j] = the column sums of grad_in before it is rounded to t (same workspace,
 * kt_colsum_workspace). */
kt_status kt_bias_gelu_grad_colsum(kt_dtype t, int out_f32, const void *grad, const void *x, const void *bias,
                                   void *grad_in, void *out, float *workspace, int64_t rows, int64_t cols,
                                   int approximate, void *stream);

/* Dropout fused with its neighbours; element i is kept as kitsune/philox.h says for
 * (seed, offset, p), kept values are scaled by 1 / (1 - p), and nothing is stored:
 * the backwards regenerate the mask from the same (seed, offset, p).
 *   kt_gelu_dropout:          out = keep ? gelu(x) / (1 - p) : 0   (approximate as in kt_bias_gelu)
 *   kt_gelu_dropout_backward: grad_x = keep ? grad / (1 - p) * gelu'(x) : 0
 *   kt_bias_dropout_add:      out = residual + (keep ? (x + bias[i % nbias]) / (1 - p) : 0)
 *   kt_dropout_backward:      grad_x = keep ? grad / (1 - p) : 0
 * 0 <= p <= 1 (p = 1 keeps nothing). */
kt_status kt_gelu_dropout(kt_dtype t, const void *x, void *out, int64_t n, double p, uint64_t seed, uint64_t offset,
                          int approximate, void *stream);
kt_status kt_gelu_dropout_backward(kt_dtype t, const void *grad, const void *x, void *grad_x, int64_t n, double p,
                                   uint64_t seed, uint64_t offset, int approximate, void *stream);
kt_status kt_bias_dropout_add(kt_dtype t, const void *x, const void *bias, const void *residual, void *out, int64_t n,
                              int64_t nbias, double p, uint64_t seed, uint64_t offset, void *stream);
kt_status kt_dropout_backward(kt_dtype t, const void *grad, void *grad_x, int64_t n, double p, uint64_t seed,
                              uint64_t offset, void *stream);

/* BatchNorm over (N, C, S) contiguous (S = spatial elements, 1 for (N, C)), plus
 * residual (x's shape and layout; may be NULL), then ReLU when relu != 0; per-channel
 * weight/bias (C elements, may be NULL).
 * training: mean and invstd (C fp32 each, written) from the batch; running_mean and
 * running_var (C fp32, may be NULL) updated with momentum (var unbiased).
 * eval (training 0): mean and invstd are inputs (from the running stats).
 * workspace: kt_batch_norm_workspace(N, C, S) fp32 values. */
kt_status kt_batch_norm(kt_dtype t, const void *x, const void *residual, void *y, const void *weight, const void *bias,
                        int64_t N, int64_t C, int64_t S, int training, float momentum, float eps, float *mean,
                        float *invstd, float *running_mean, float *running_var, float *workspace, int relu,
                        void *stream);
/* grad_x of kt_batch_norm (y its output, needed with relu: g' = grad where y > 0);
 * sum_g and sum_gx (C fp32, written) are sum(g') and sum(g' * xhat): the bias and
 * weight gradients; grad_residual (may be NULL) gets g', the residual's gradient. */
kt_status kt_batch_norm_backward(kt_dtype t, const void *grad, const void *x, const void *y, void *grad_x,
                                 void *grad_residual, const void *weight, int64_t N, int64_t C, int64_t S, int training,
                                 const float *mean, const float *invstd, float *sum_g, float *sum_gx, float *workspace,
                                 int relu, void *stream);
int64_t kt_batch_norm_workspace(int64_t N, int64_t C, int64_t S);

/* ---- pointwise chains: one launch runs a small program over every element ----
 * A chain is a straight-line program over fp32 registers, given at launch (no code
 * is generated): registers 0 .. n_in-1 hold the element of each input, each op
 * writes one register from up to three others (or a constant), and each output
 * stores one register, rounded once to its dtype. Inputs have any strides over the
 * output's shape (stride 0 along a broadcast dimension, in elements); outputs have the
 * strides out_stride gives (a dense layout: contiguous, channels-last, a transpose). Dtypes: KT_F32, KT_F16, KT_BF16, or KT_CHAIN_BOOL (one
 * byte, 0 or 1; loaded as 0.0 / 1.0, stored as value != 0). kt_chain_check says
 * KT_ERR_INVALID for a program that reads a register before it is written, an op
 * or register or constant out of range, or a bad count, shape or dtype. */
#define KT_CHAIN_MAX_IN 8
#define KT_CHAIN_MAX_OUT 4
#define KT_CHAIN_MAX_OPS 64
#define KT_CHAIN_MAX_REGS 32
#define KT_CHAIN_MAX_DIM 6
#define KT_CHAIN_MAX_CONST 16
#define KT_CHAIN_BOOL 3
typedef enum kt_chain_opcode {
  KT_OP_CONST = 0,   /* dst = consts[a] */
  KT_OP_ADD, KT_OP_SUB, KT_OP_MUL, KT_OP_DIV,
  KT_OP_MAX, KT_OP_MIN,   /* NaN if either is NaN (torch.maximum / minimum) */
  KT_OP_POW,   /* a ** b (powf) */
  KT_OP_NEG, KT_OP_EXP, KT_OP_LOG, KT_OP_TANH, KT_OP_SIGMOID, KT_OP_ERF, KT_OP_RSQRT, KT_OP_SQRT,
  KT_OP_RELU, KT_OP_GELU, KT_OP_GELU_TANH, KT_OP_SILU, KT_OP_ABS, KT_OP_RECIP, KT_OP_LOG1P,
  KT_OP_GT, KT_OP_LT, KT_OP_GE, KT_OP_LE, KT_OP_EQ, KT_OP_NE,   /* 1.0 or 0.0 */
  KT_OP_WHERE,   /* a != 0 ? b : c */
  KT_OP_ROUND_BF16, KT_OP_ROUND_F16,   /* a rounded to bf16 / fp16 and back: a cast */
  KT_OP_TO_BOOL,   /* a != 0 */
  KT_OP_GELU_BWD, KT_OP_GELU_TANH_BWD,   /* a * gelu'(b): gelu_backward(grad = a, x = b) */
  KT_OP_COUNT
} kt_chain_opcode;
typedef struct kt_chain_op {
  uint8_t op, dst, a, b, c;
} kt_chain_op;
typedef struct kt_chain {
  int32_t n_in, n_out, n_ops, ndim;
  int64_t shape[KT_CHAIN_MAX_DIM];
  int64_t in_stride[KT_CHAIN_MAX_IN][KT_CHAIN_MAX_DIM];
  int64_t out_stride[KT_CHAIN_MAX_OUT][KT_CHAIN_MAX_DIM];
  int32_t in_dtype[KT_CHAIN_MAX_IN], out_dtype[KT_CHAIN_MAX_OUT], out_reg[KT_CHAIN_MAX_OUT];
  float consts[KT_CHAIN_MAX_CONST];
  kt_chain_op ops[KT_CHAIN_MAX_OPS];
} kt_chain;
kt_status kt_chain_check(const kt_chain *c);
/* in: n_in pointers, out: n_out pointers (NULL allowed when there are no elements) */
kt_status kt_chain_run(const kt_chain *c, const void *const *in, void *const *out, void *stream);
/* The kernel's per-element code run on the CPU over host memory (for tests: it checks the
 * kernel's addressing and arithmetic against an independent reference without a GPU). */
kt_status kt_chain_run_host(const kt_chain *c, const void *const *in, void *const *out);

#ifdef __cplusplus
}
#endif
#endif
