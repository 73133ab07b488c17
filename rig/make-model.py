#!/usr/bin/python3
"""Write a small random-weight GGUF model for the test rig.

The tokenizer is copied from llama.cpp's vocab-only file
models/ggml-vocab-llama-spm.gguf; the weights are random f16 numbers from a
fixed seed (norms and conv weights f32, as llama.cpp wants them), so the same
file comes out every time.  Random weights make meaningless text, but real
prefill cost, real KV files and real cache_n figures, which is what the rig
needs.

usage: make-model.py LLAMA_CPP_SRC OUT.gguf [LAYERS] [--arch ARCH]

ARCH (default llama):
  llama   n_embd 256, 4 heads, 8 layers (LAYERS), ChatML; the file is the
          same byte for byte as before --arch existed
  gemma3  sliding-window attention: 6 layers, every 6th global, the others
          with a 256-token window (sliding_window 256, rope_freq_base_swa),
          q/k norms and post-attention/post-ffw norms
  lfm2    hybrid: short-conv layers (l_cache 3) and attention layers, the
          attention ones every 3rd (6 layers: attention at 2 and 5)
All three: n_embd 256, head dim 64, n_ff 1024, the same vocab and ChatML
template.
"""

import os
import sys

import numpy as np

ARCHS = ("llama", "gemma3", "lfm2")
# the default number of layers of each architecture
LAYERS = {"llama": 8, "gemma3": 6, "lfm2": 6}


def usage(msg):
    sys.exit("make-model.py: %s\nusage: make-model.py LLAMA_CPP_SRC OUT.gguf "
             "[LAYERS] [--arch %s]" % (msg, "|".join(ARCHS)))


arch = "llama"
pos = []
argv = sys.argv[1:]
while argv:
    a = argv.pop(0)
    if a == "--arch":
        if not argv:
            usage("--arch needs a value")
        arch = argv.pop(0)
    elif a.startswith("--arch="):
        arch = a[len("--arch="):]
    elif a.startswith("-") and not a.lstrip("-").isdigit():
        usage("unknown option " + a)
    else:
        pos.append(a)
if arch not in ARCHS:
    usage("unknown architecture " + arch)
if len(pos) not in (2, 3):
    usage("wrong number of arguments")
src, out = pos[0], pos[1]
# a third argument: the number of layers (a second model of another size)
n_layer = int(pos[2]) if len(pos) > 2 else LAYERS[arch]
if n_layer < 1:
    usage("LAYERS must be at least 1")
sys.path.insert(0, os.path.join(src, "gguf-py"))
import gguf  # noqa: E402

N_EMBD = 256
N_HEAD = 4
N_HEAD_KV = 4
N_LAYER = n_layer
N_FF = 1024
N_CTX_TRAIN = 32768
HEAD_DIM = N_EMBD // N_HEAD

# gemma3: the window of its sliding-window layers; every SWA_PATTERN-th
# layer is global (the architecture's default pattern, written explicitly)
SWA_WINDOW = 256
SWA_PATTERN = 6
# lfm2: the short convolution's length, and which layers are attention
# (the others are short-conv): every 3rd, so 6 layers have it at 2 and 5
L_CACHE = 3


def lfm2_attention(i):
    return i % 3 == 2


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

# The llama file's keys and tensors keep their order and the random numbers
# their sequence: the llama model comes out as it did before the other
# architectures were added (its cached file keeps its name).
w = gguf.GGUFWriter(out + ".tmp", arch)
w.add_name("llama-session-rig-tiny" if arch == "llama"
           else "llama-session-rig-tiny-" + arch)
w.add_context_length(N_CTX_TRAIN)
w.add_embedding_length(N_EMBD)
w.add_block_count(N_LAYER)
w.add_feed_forward_length(N_FF)
w.add_head_count(N_HEAD)
if arch == "lfm2":
    # per layer: 0 makes a layer short-conv (llama.cpp's is_recr)
    w.add_head_count_kv([N_HEAD_KV if lfm2_attention(i) else 0
                         for i in range(N_LAYER)])
else:
    w.add_head_count_kv(N_HEAD_KV)
if arch == "llama":
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
elif arch == "gemma3":
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_sliding_window(SWA_WINDOW)
    w.add_sliding_window_pattern(SWA_PATTERN)
    w.add_rope_freq_base(1000000.0)
    w.add_rope_freq_base_swa(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
else:
    w.add_shortconv_l_cache(L_CACHE)
    w.add_rope_freq_base(1000000.0)
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


def rand32(*shape, scale=0.02):
    # f32: what llama.cpp's ggml_ssm_conv needs for the conv weights
    return rng.standard_normal(shape, dtype=np.float32) * scale


def ones(n):
    return np.ones(n, dtype=np.float32)


# numpy shapes are [rows, columns]: ggml's {columns, rows}
kv = HEAD_DIM * N_HEAD_KV
w.add_tensor("token_embd.weight", rand(n_vocab, N_EMBD))
# lfm2's output norm has the name "token_embd_norm" (llama.cpp's
# LLM_TENSOR_OUTPUT_NORM_LFM2)
w.add_tensor("token_embd_norm.weight" if arch == "lfm2"
             else "output_norm.weight", ones(N_EMBD))
w.add_tensor("output.weight", rand(n_vocab, N_EMBD))
for i in range(N_LAYER):
    p = "blk.%d." % i
    w.add_tensor(p + "attn_norm.weight", ones(N_EMBD))
    if arch == "lfm2" and not lfm2_attention(i):
        w.add_tensor(p + "shortconv.conv.weight", rand32(N_EMBD, L_CACHE))
        w.add_tensor(p + "shortconv.in_proj.weight",
                     rand(3 * N_EMBD, N_EMBD))
        w.add_tensor(p + "shortconv.out_proj.weight", rand(N_EMBD, N_EMBD))
    else:
        w.add_tensor(p + "attn_q.weight", rand(N_EMBD, N_EMBD))
        w.add_tensor(p + "attn_k.weight", rand(kv, N_EMBD))
        w.add_tensor(p + "attn_v.weight", rand(kv, N_EMBD))
        if arch != "llama":
            w.add_tensor(p + "attn_q_norm.weight", ones(HEAD_DIM))
            w.add_tensor(p + "attn_k_norm.weight", ones(HEAD_DIM))
        w.add_tensor(p + "attn_output.weight", rand(N_EMBD, N_EMBD))
    if arch == "gemma3":
        w.add_tensor(p + "post_attention_norm.weight", ones(N_EMBD))
    w.add_tensor(p + "ffn_norm.weight", ones(N_EMBD))
    w.add_tensor(p + "ffn_gate.weight", rand(N_FF, N_EMBD))
    w.add_tensor(p + "ffn_up.weight", rand(N_FF, N_EMBD))
    w.add_tensor(p + "ffn_down.weight", rand(N_EMBD, N_FF))
    if arch == "gemma3":
        w.add_tensor(p + "post_ffw_norm.weight", ones(N_EMBD))

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
os.rename(out + ".tmp", out)
