#!/usr/bin/python3
"""Write a small random-weight llama GGUF model for the test rig.

The tokenizer is copied from llama.cpp's vocab-only file
models/ggml-vocab-llama-spm.gguf; the weights are random f16 numbers from a
fixed seed, so the same file comes out every time.  Random weights make
meaningless text, but real prefill cost, real KV files and real cache_n
figures, which is what the rig needs.

usage: make-model.py LLAMA_CPP_SRC OUT.gguf
"""

import os
import sys

import numpy as np

src, out = sys.argv[1], sys.argv[2]
# a third argument: the number of layers (a second model of another size)
n_layer = int(sys.argv[3]) if len(sys.argv) > 3 else 8
sys.path.insert(0, os.path.join(src, "gguf-py"))
import gguf  # noqa: E402

N_EMBD = 256
N_HEAD = 4
N_HEAD_KV = 4
N_LAYER = n_layer
N_FF = 1024
N_CTX_TRAIN = 32768

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

vocab = gguf.GGUFReader(os.path.join(src, "models",
                                     "ggml-vocab-llama-spm.gguf"))
tokens = vocab.fields["tokenizer.ggml.tokens"].contents()
n_vocab = len(tokens)

w = gguf.GGUFWriter(out + ".tmp", "llama")
w.add_name("llama-session-rig-tiny")
w.add_context_length(N_CTX_TRAIN)
w.add_embedding_length(N_EMBD)
w.add_block_count(N_LAYER)
w.add_feed_forward_length(N_FF)
w.add_head_count(N_HEAD)
w.add_head_count_kv(N_HEAD_KV)
w.add_rope_dimension_count(N_EMBD // N_HEAD)
w.add_layer_norm_rms_eps(1e-5)
w.add_vocab_size(n_vocab)
w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

w.add_tokenizer_model("llama")
w.add_tokenizer_pre("default")
w.add_token_list(tokens)
w.add_token_scores(vocab.fields["tokenizer.ggml.scores"].contents())
w.add_token_types(vocab.fields["tokenizer.ggml.token_type"].contents())
w.add_bos_token_id(1)
w.add_eos_token_id(2)
w.add_unk_token_id(0)
w.add_add_bos_token(True)
w.add_add_eos_token(False)
w.add_chat_template(CHATML)

rng = np.random.default_rng(1234)


def rand(*shape, scale=0.02):
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(
        np.float16)


def ones(n):
    return np.ones(n, dtype=np.float32)


w.add_tensor("token_embd.weight", rand(n_vocab, N_EMBD))
w.add_tensor("output_norm.weight", ones(N_EMBD))
w.add_tensor("output.weight", rand(n_vocab, N_EMBD))
kv = N_EMBD // N_HEAD * N_HEAD_KV
for i in range(N_LAYER):
    p = "blk.%d." % i
    w.add_tensor(p + "attn_norm.weight", ones(N_EMBD))
    w.add_tensor(p + "attn_q.weight", rand(N_EMBD, N_EMBD))
    w.add_tensor(p + "attn_k.weight", rand(kv, N_EMBD))
    w.add_tensor(p + "attn_v.weight", rand(kv, N_EMBD))
    w.add_tensor(p + "attn_output.weight", rand(N_EMBD, N_EMBD))
    w.add_tensor(p + "ffn_norm.weight", ones(N_EMBD))
    w.add_tensor(p + "ffn_gate.weight", rand(N_FF, N_EMBD))
    w.add_tensor(p + "ffn_up.weight", rand(N_FF, N_EMBD))
    w.add_tensor(p + "ffn_down.weight", rand(N_EMBD, N_FF))

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
os.rename(out + ".tmp", out)
