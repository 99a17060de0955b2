"""What kitsune.optimize and Kitsune's Dynamo path fuse in tiny Hugging Face models (random
weights from configs, nothing downloaded), on the CPU: the first line of each explain().

    PYTHONPATH=python KITSUNE_LIBRARY=build/libkitsune.so python3 tools/hf_fusion_counts.py
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers as T  # noqa: E402

import kitsune  # noqa: E402

for name, m in [("gpt2", T.GPT2LMHeadModel(T.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4))),
                ("llama", T.LlamaForCausalLM(T.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))),
                ("bert", T.BertForMaskedLM(T.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)))]:
    ids = torch.randint(3, 96, (2, 12))
    a = kitsune.explain(m); b = kitsune.explain(m.train(), input_ids=ids, labels=ids, dynamo=True)
    print(name, "optimize:", str(a).splitlines()[0], "| dynamo:", str(b).splitlines()[0])
