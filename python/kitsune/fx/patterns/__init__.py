"""The rewrites, one module a family of the ops they produce: pointwise (add_relu,
mul_tanh, bias_gelu, swiglu), norms (layer_norm_relu, add_layer_norm, rms_norm),
batch_norm (batch_norm_relu, batch_norm_add_relu, the batch counts), loss
(cross_entropy, linear_cross_entropy, FusedLoss), dropout (gelu_dropout,
bias_dropout_add), linear (linear_act, attention_score), conv (channel_bias,
bias_relu_pool, bias_cat), pool (max_pool2d, max_pool2d_branches, global_avg_pool),
embedding. A node rewrite is ``rw(gm, g, node, where, report) -> bool`` (True: the node
is taken, try no other); an activation's is ``rw(gm, g, node, act, where, report)``.
kitsune.fx.engine tries them in its tables' order."""
