// python/kitsune/csrc/library.cpp — torch.ops.kitsune: every op's schema, one row an op.
// The kernels are registered beside their code: ops/<family>.cpp (CUDA, CPU, Autograd,
// composite kernels), autocast.cpp (Autocast), pinned.cpp (pinned_empty); fake kernels
// in kitsune/ops/<family>.py; the stream_* ops' kernels in kitsune/sched/streams.py.
#include <torch/library.h>

TORCH_LIBRARY(kitsune, m) {
  // A CPU tensor in page-locked memory from Kitsune's pinned pool (pinned.cpp).
  m.def("pinned_empty(int[] size, ScalarType dtype) -> Tensor");
  m.def("add_relu(Tensor a, Tensor b) -> Tensor");
  m.def("add_relu_backward(Tensor grad, Tensor out) -> Tensor");
  m.def("mul_tanh(Tensor a, Tensor b) -> Tensor");
  m.def("mul_tanh_backward(Tensor grad, Tensor a, Tensor b) -> (Tensor, Tensor)");
  m.def("bias_gelu(Tensor x, Tensor bias, str approximate='none') -> Tensor");
  m.def("bias_gelu_backward(Tensor grad, Tensor x, Tensor bias, str approximate='none') -> (Tensor, Tensor)");
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  m.def("pointwise_chain(Tensor[] inputs, int[] program, float[] consts, int[] out_regs, ScalarType[] out_dtypes, int[] out_strides=[]) -> Tensor[]");
  m.def("_pointwise_chain_interpreted(Tensor[] inputs, int[] program, float[] consts, int[] out_regs, ScalarType[] out_dtypes, int[] out_strides=[]) -> Tensor[]");
  m.def("rms_norm(Tensor x, Tensor weight, float eps=1e-6) -> Tensor");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, float eps=1e-6) -> (Tensor, Tensor)");
  m.def("layer_norm_relu(Tensor x, int[] normalized_shape, Tensor? weight=None, Tensor? bias=None, float eps=1e-5) -> Tensor");
  m.def("layer_norm_relu_backward(Tensor grad, Tensor x, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("add_layer_norm(Tensor x, Tensor residual, Tensor? weight=None, Tensor? bias=None, float eps=1e-5) -> (Tensor, Tensor)");
  m.def("add_layer_norm_backward(Tensor grad, Tensor? grad_sum, Tensor sum, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("cross_entropy(Tensor logits, Tensor target, int ignore_index=-100, float label_smoothing=0.0, bool float_loss=False) -> Tensor");
  m.def("cross_entropy_backward(Tensor grad, Tensor logits, Tensor target, int ignore_index=-100, float label_smoothing=0.0) -> Tensor");
  m.def("cross_entropy_with_grad(Tensor logits, Tensor target, int ignore_index=-100, float label_smoothing=0.0, bool float_loss=False) -> (Tensor, Tensor)");
  m.def("cross_entropy_rescale_(Tensor(a!) grad, Tensor by) -> ()");
  m.def("linear_cross_entropy(Tensor x, Tensor weight, Tensor target, Tensor? bias=None, int ignore_index=-100, float label_smoothing=0.0, int chunk_size=0, bool float_loss=False) -> Tensor");
  m.def("linear_cross_entropy_grads(Tensor x, Tensor weight, Tensor target, Tensor? bias=None, int ignore_index=-100, float label_smoothing=0.0, int chunk_size=0, bool float_loss=False) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("sum_squared(Tensor x, int[1]? dim=None, bool keepdim=False) -> Tensor");
  m.def("mean_abs(Tensor x, int[1]? dim=None, bool keepdim=False) -> Tensor");
  m.def("attention_score(Tensor q, Tensor k, float? scale=None) -> Tensor");
  m.def("gelu_dropout(Tensor x, float p, bool training=True, str approximate='none') -> (Tensor, Tensor)");
  m.def("gelu_dropout_backward(Tensor grad, Tensor x, Tensor rng, float p, str approximate='none') -> Tensor");
  m.def("bias_dropout_add(Tensor x, Tensor bias, Tensor residual, float p, bool training=True) -> (Tensor, Tensor)");
  m.def("dropout_backward(Tensor grad, Tensor rng, float p) -> Tensor");
  m.def("dropout_mask(Tensor rng, int n, float p, ScalarType dtype=float) -> Tensor");
  m.def("adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, float lr, float beta1, float beta2, float eps, float weight_decay, bool decoupled, float step) -> ()");
  m.def("adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] state_steps, float lr, float beta1, float beta2, float eps, float weight_decay, bool decoupled) -> ()");
  m.def("adam_capturable_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, Tensor(d!) hyper, float beta1, float beta2, float eps, float weight_decay, bool decoupled, bool count_step=True, Tensor? found_inf=None) -> ()");
  m.def("sgd_capturable_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, Tensor hyper, float momentum, float dampening, float weight_decay, bool nesterov, Tensor? found_inf=None) -> ()");
  m.def("optim_fusable(Tensor[] params, Tensor[] grads) -> bool");
  m.def("sgd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, float lr, float momentum, float dampening, float weight_decay, bool nesterov, bool first) -> ()");
  m.def("batch_norm_relu(Tensor x, Tensor? weight, Tensor? bias, Tensor(a!)? running_mean, Tensor(b!)? running_var, bool training, float momentum, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("batch_norm_relu_backward(Tensor grad, Tensor x, Tensor out, Tensor? weight, Tensor save_mean, Tensor save_invstd, bool training) -> (Tensor, Tensor, Tensor)");
  m.def("batch_norm_add_relu(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, Tensor(a!)? running_mean, Tensor(b!)? running_var, bool training, float momentum, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("batch_norm_add_relu_backward(Tensor grad, Tensor x, Tensor out, Tensor? weight, Tensor save_mean, Tensor save_invstd, bool training) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("linear_act(Tensor x, Tensor weight, Tensor bias, str act='relu') -> Tensor");
  m.def("channel_bias(Tensor y, Tensor bias, str act='none') -> Tensor");
  m.def("bias_relu_pool(Tensor y, Tensor bias, int[] kernel_size) -> Tensor");
  m.def("max_pool2d(Tensor x, int[] kernel_size, int[] stride, int[] padding, bool ceil_mode) -> Tensor");
  m.def("max_pool2d_where(Tensor x, int[] kernel_size, int[] stride, int[] padding, bool ceil_mode) -> (Tensor, Tensor)");
  m.def("max_pool2d_backward_add(Tensor? grad, Tensor where, Tensor[] adds, int[] input_size, int[] kernel_size, int[] stride, int[] padding, bool ceil_mode) -> Tensor");
  m.def("embedding(Tensor weight, Tensor indices, int padding_idx=-1) -> Tensor");
  m.def("global_avg_pool(Tensor x, int[] dim, bool keepdim=False) -> Tensor");
  m.def("bias_cat(Tensor[] xs, Tensor[] biases, int dim=1) -> Tensor");
  m.def("channel_sum(Tensor g) -> Tensor");
  // A streamed module's stream changes, kept in order by the graph (kitsune.sched.streamed);
  // ctx names its stream context. Their kernels switch torch's current stream (Python).
  m.def("stream_fork(Tensor x, int ctx) -> ()");
  m.def("stream_switch(Tensor[] cross, int ctx, int stream, int[] waits) -> ()");
  m.def("stream_record(int ctx, int event) -> ()");
  m.def("stream_join(int ctx) -> ()");
}

// Ops with a CUDA kernel (NAME_cuda) and a CPU reference (NAME_cpu), one list so the
