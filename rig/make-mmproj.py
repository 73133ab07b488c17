#!/usr/bin/python3
"""Write a small random-weight multimodal projector GGUF ("mmproj") for the
test rig.

It is a llava-style projector: a tiny CLIP vision encoder (32x32-pixel
images cut into 8x8 patches, a class embedding, two transformer layers)
and the "mlp" projector (mm.0, GELU, mm.2) that maps its output to the text
model's n_embd (256, rig/make-model.py).  llama-server loads it with
--mmproj FILE next to any of the rig's text models and then takes images in
chat requests: each image becomes 16 embeddings (4x4 patches) in the prompt.
The weights are random f16 numbers from a fixed seed (norms, biases and the
class embedding f32, as clip.cpp wants them), so the same file comes out
every time.  Random weights make meaningless embeddings, but a real image
path through llama-server (decode, encode, KV cells that hold an image),
which is what the rig needs.

The keys and tensor names are those clip.cpp / clip-impl.h of the llama.cpp
tree read for PROJECTOR_TYPE_MLP (graph: tools/mtmd/models/llava.cpp).

usage: make-mmproj.py LLAMA_CPP_SRC OUT.gguf
"""

import os
import sys

import numpy as np

if len(sys.argv) != 3:
    sys.exit("usage: make-mmproj.py LLAMA_CPP_SRC OUT.gguf")
src, out = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(src, "gguf-py"))
import gguf  # noqa: E402

# the text model's n_embd: the projector's output must match it, or
# llama-server refuses the pair ("mismatch between text model and mmproj")
N_EMBD_TEXT = 256

IMAGE_SIZE = 32
PATCH_SIZE = 8
N_PATCHES = (IMAGE_SIZE // PATCH_SIZE) ** 2
# +1: the class embedding's position (CLIP); the projector skips it
N_POS = N_PATCHES + 1
N_EMBD = 128
N_HEAD = 4
# not equal to N_EMBD: clip.cpp takes an ffn_down whose input is n_embd
# wide for an old file with up and down swapped, and swaps them back
N_FF = 512
# two layers: llava feeds the projector the second-to-last layer's output,
# so the encoder runs one of them (the other is loaded, as in a real file)
N_LAYER = 2
# the projector's hidden width (mm.0's output, mm.2's input)
N_MM_HIDDEN = 256

w = gguf.GGUFWriter(out + ".tmp", "clip")
w.add_name("llama-session-rig-tiny-mmproj")
w.add_description("random-weight llava-style mmproj for the "
                  "llama-session test rig")
w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
w.add_clip_has_vision_encoder(True)
w.add_clip_projector_type("mlp")
w.add_vision_image_size(IMAGE_SIZE)
w.add_vision_patch_size(PATCH_SIZE)
w.add_vision_embedding_length(N_EMBD)
w.add_vision_feed_forward_length(N_FF)
w.add_vision_block_count(N_LAYER)
w.add_vision_head_count(N_HEAD)
w.add_vision_attention_layernorm_eps(1e-5)
w.add_vision_projection_dim(N_EMBD_TEXT)
# clip.cpp refuses a vision file without three of each; CLIP's own values
w.add_vision_image_mean([0.48145466, 0.4578275, 0.40821073])
w.add_vision_image_std([0.26862954, 0.26130258, 0.27577711])
# CLIP's quick GELU (clip.cpp's default when neither use_gelu nor use_silu)
w.add_vision_use_gelu(False)

rng = np.random.default_rng(1234)


def rand(*shape, scale=0.02):
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(
        np.float16)


def rand32(*shape, scale=0.02):
    # f32: ggml_concat wants the class embedding of the patches' type
    return rng.standard_normal(shape, dtype=np.float32) * scale


def ones(n):
    return np.ones(n, dtype=np.float32)


def zeros(n):
    return np.zeros(n, dtype=np.float32)


# numpy shapes are [rows, columns]: ggml's {columns, rows}; the patch
# embedding is the 2D convolution's kernel, ggml {PATCH, PATCH, 3, N_EMBD}
w.add_tensor("v.patch_embd.weight", rand(N_EMBD, 3, PATCH_SIZE, PATCH_SIZE))
w.add_tensor("v.class_embd", rand32(N_EMBD))
w.add_tensor("v.position_embd.weight", rand(N_POS, N_EMBD))
w.add_tensor("v.pre_ln.weight", ones(N_EMBD))
w.add_tensor("v.pre_ln.bias", zeros(N_EMBD))
for i in range(N_LAYER):
    p = "v.blk.%d." % i
    w.add_tensor(p + "ln1.weight", ones(N_EMBD))
    w.add_tensor(p + "ln1.bias", zeros(N_EMBD))
    for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
        w.add_tensor(p + t + ".weight", rand(N_EMBD, N_EMBD))
        w.add_tensor(p + t + ".bias", zeros(N_EMBD))
    w.add_tensor(p + "ln2.weight", ones(N_EMBD))
    w.add_tensor(p + "ln2.bias", zeros(N_EMBD))
    w.add_tensor(p + "ffn_up.weight", rand(N_FF, N_EMBD))
    w.add_tensor(p + "ffn_up.bias", zeros(N_FF))
    w.add_tensor(p + "ffn_down.weight", rand(N_EMBD, N_FF))
    w.add_tensor(p + "ffn_down.bias", zeros(N_EMBD))
# llava has no post-layernorm on the layer it projects; clip.cpp takes the
# file without one
w.add_tensor("mm.0.weight", rand(N_MM_HIDDEN, N_EMBD))
w.add_tensor("mm.0.bias", zeros(N_MM_HIDDEN))
w.add_tensor("mm.2.weight", rand(N_EMBD_TEXT, N_MM_HIDDEN))
w.add_tensor("mm.2.bias", zeros(N_EMBD_TEXT))

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
os.rename(out + ".tmp", out)
