"""Weight-only formats, converted at load from any checkpoint, widened inside the matmul;
activations and accumulation stay in the model's dtype (float32 on the CPU).

bf16: the weights rounded to bfloat16, `qweight` bf16 [..., out, in], no scale. Half the
bytes of float32 and no scale arithmetic; on the CPU `kernels_pallas.bf16_matmul` reads them
in place for few tokens and runs oneDNN's bf16 matmul for many (docs/benchmarks.md).
Packed bf16 (CPU, where oneDNN's bf16 matmul is native; `pack_params` after loading): each
projection's `qweight` becomes `packed` [..., S], reordered once into oneDNN's blocked
layout, read by `bf16_matmul_packed` (an AVX512-BF16 kernel for few tokens, oneDNN beyond, no
per-call repacking); a tied embedding keeps its `qweight` rows for the lookup and gains a
`packed` copy for the LM head.

int8: symmetric int8 weights with per-output-channel scales in groups of 64 input channels:

    qweight  int8 [..., out, in]          round(w / scale), in [-127, 127]
    scale    f32  [..., out, in // 64]    max |w| over each group of 64 inputs / 127

    y = x @ (qweight * scale per group).T

A group of 64 costs nothing in speed (the scaling fuses into the same convert) and
1/16 more memory, and agrees with float32 more often than one scale per output channel
(docs/benchmarks.md, "Figures behind choices in the code"). An input dimension that 64
does not divide gets one scale per output channel.

Any checkpoint is quantized at load on the host, so every format and platform gets
it: by the loaders one tensor at a time (`build_params`), or, when tensor parallelism
must first pad or replicate heads on float weights, by `quantize_params` afterwards.
The layout is PyTorch's `[out, in]`, not Flax's `[in, out]`: contiguous int8 rows are what
both XLA's CPU matrix-vector product and the CPU kernel read best (measured: same section). Embedding rows are quantized
the same way, so a tied LM head (`attend`) uses them as its output channels.

The int8 matmul: up to 32 tokens on the CPU, `kernels_pallas.int8_matmul`'s C++ kernel (int8
read once, converted in registers); otherwise, and on GPU/TPU, XLA's
dequantize-then-dot. Inside the layer scan the weights of either format stay whole
(INT8_LAYERS).

A checkpoint stored quantized and served at its stored width (WeightFormat.from_checkpoint,
models/checkpoint_quant.py) uses the same layout with its own values and groups: `qweight`
int8, int4 or float8_e4m3fn [..., out, in] and `scale` [..., out, in // group] (the
checkpoint's group, block width, or one per channel). Its embedding and LM head stay in the
model's dtype, as such checkpoints store them.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import kernels_pallas.bf16_matmul as bf16_kernel
import kernels_pallas.int8_matmul as int8_kernel
from jaxserve.config import WeightFormat
from jaxserve.models.variables import INT8_LAYERS

GROUP_SIZE = 64


def to_bf16(w: np.ndarray, in_axis: int) -> np.ndarray:
    """`w` [..., in, out] (in_axis=-2) or [..., out, in] (in_axis=-1) -> bfloat16 [..., out, in]
    (rounded to nearest even, as JAX's and PyTorch's casts)."""
    w = np.asarray(w, np.float32)
    if in_axis in (-2, w.ndim - 2):
        w = np.swapaxes(w, -1, -2)
    return np.ascontiguousarray(w.astype(jnp.bfloat16))


def quantize_weight(w: np.ndarray, fmt: WeightFormat, in_axis: int) -> dict[str, np.ndarray]:
    """One matrix in `fmt`: {"qweight": [..., out, in]} (+ "scale" for int8)."""
    if fmt.bf16:
        return {"qweight": to_bf16(w, in_axis)}
    qweight, scale = quantize_int8(w, in_axis)
    return {"qweight": qweight, "scale": scale}

def quantize_int8(w: np.ndarray, in_axis: int, group_size: int = GROUP_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output channel and group of `group_size` inputs: `w` [..., in, out]
    (in_axis=-2) or [..., out, in] (in_axis=-1) -> (qweight int8 [..., out, in],
    scale float32 [..., out, in // group_size]; one group when it does not divide `in`)."""
    w = np.asarray(w, np.float32)
    if in_axis in (-2, w.ndim - 2):
        w = np.swapaxes(w, -1, -2)
    n_in = w.shape[-1]
    g = group_size if n_in % group_size == 0 else n_in
    groups = w.reshape(*w.shape[:-1], n_in // g, g)
    absmax = np.abs(groups).max(axis=-1)
    # An all-zero group (padded heads) keeps scale 1 rather than dividing by 0.
    scale = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(groups / scale[..., None]), -127, 127).astype(np.int8)
    return np.ascontiguousarray(q.reshape(w.shape)), scale


# qweight [..., out, in], scale [..., out, groups] -> float [..., out, in]; NumPy or JAX.
dequantize_int8 = int8_kernel.dequantize


def quantize_params(params: dict[str, Any], fmt: WeightFormat) -> dict[str, Any]:
    """Quantize a host param tree `{"params": ...}` in place of its float projections.

    `WeightFormat.FLOAT` and a checkpoint's own format return `params` unchanged; leaves a
    loader delivered quantized already are kept. Norms, biases and q/k norms stay float.
    (bf16 packed: plain bf16 rows here; `pack_params` packs them.)
    """
    if not fmt.quantized or fmt.from_checkpoint:
        return params

    def walk(node: dict[str, Any], name: str) -> dict[str, Any]:
        # Every Dense "kernel" [..., in, out] (layer projections, a separate LM head) and
        # the embedding [vocab, hidden] become qweight (/ scale); other leaves stay.
        node = {k: walk(v, k) if isinstance(v, dict) else v for k, v in node.items()}
        for k in ("w_gate", "w_up", "w_down"):  # a mixture of experts' stacks [.., in, out]
            if k in node and not isinstance(node[k], dict):
                check_experts(fmt)
                node[k] = quantize_weight(node[k], fmt, in_axis=-2)
        if "kernel" in node:
            node.update(quantize_weight(node.pop("kernel"), fmt, in_axis=-2))
        elif name == "embed_tokens" and "embedding" in node:
            node.update(quantize_weight(node.pop("embedding"), fmt, in_axis=-1))
        return node

    return {**params, "params": walk(params["params"], "params")}


def pack_params(params: dict[str, Any], tied: bool) -> dict[str, Any]:
    """A host param tree with bf16 weights (`quantize_params(..., WeightFormat.BF16)`) for the CPU's
    packed path: every projection's `qweight` [..., out, in] becomes `packed` [..., S]
    (`kernels_pallas.bf16_matmul.pack_weights`); with `tied` embeddings the embedding keeps
    its rows and gains `packed` ones for the LM head. The model runs it with
    `WeightFormat.BF16_PACKED`."""

    def walk(node: dict[str, Any], name: str) -> dict[str, Any]:
        node = {k: walk(v, k) if isinstance(v, dict) else v for k, v in node.items()}
        q = node.get("qweight")
        if q is None or "scale" in node or np.dtype(q.dtype) != jnp.bfloat16:
            return node
        if name == "embed_tokens" and not tied:
            return node
        keep = {k: v for k, v in node.items() if k != "qweight" or name == "embed_tokens"}
        return {**keep, "packed": bf16_kernel.pack_weights(np.asarray(q))}

    return {**params, "params": walk(params["params"], "params")}


def check_experts(fmt: WeightFormat) -> None:
    """Raise ValueError naming the field: bf16 weights do not cover experts yet."""
    if fmt.bf16:
        raise ValueError("quantization 'bf16' does not cover mixture-of-experts models yet; "
                         "use 'int8' or leave it unset")


# XLA's CPU backend dequantizes a matmul's weights into a temporary before the product: a
# temporary that stays in cache costs little, one the size of an LM head costs more than the
# float32 matmul itself. So on the CPU a matrix over CHUNK_ABOVE elements is multiplied in
# chunks of output rows of at most CHUNK_ELEMENTS, in a loop. Layer matrices are not chunked:
# chunking them doubled a decode step. Measured, not derived (docs/benchmarks.md, "Figures
# behind choices in the code").
# Few tokens skip all this: the CPU kernel (kernels_pallas.int8_matmul) reads int8 directly.
CHUNK_ABOVE = 1 << 22
CHUNK_ELEMENTS = 1 << 21


def _row_chunks(out: int, n_in: int) -> int:
    """The fewest chunks of whole rows, dividing `out`, of at most CHUNK_ELEMENTS each."""
    if out * n_in <= CHUNK_ABOVE:
        return 1
    n = -(-out * n_in // CHUNK_ELEMENTS)
    while out % n:
        n += 1
    return n


def int8_matmul_rows(
    x: jax.Array, qweight: jax.Array, scale: jax.Array, layer: jax.Array | None = None,
    cpu_kernel: bool = True,
) -> jax.Array:
    """x [..., in] @ dequantized(qweight [(L,) out, in] at `layer`).T: the platform's kernel
    where it applies (`cpu_kernel`: one device per stage; both kernels read the layer out of
    the whole stack), else XLA's dequantize-then-dot, on the CPU in chunks for a big matrix.
    The CPU's choice is made per platform at lowering, as the kernels' own, so a program
    compiled for a TPU from a CPU process (the preflight) gets the TPU's."""
    out, n_in = qweight.shape[-2:]
    n = _row_chunks(out, n_in)

    def whole() -> jax.Array:
        return int8_kernel.int8_matmul(x, qweight, scale, layer,
                                       backend="auto" if cpu_kernel else "reference")

    if n == 1:
        return whole()
    if cpu_kernel and int8_kernel.cpu_kernel_applies(x, qweight, scale):
        return whole()  # on the CPU the kernel, which needs no chunks
    return jax.lax.platform_dependent(cpu=lambda: _chunked(x, qweight, scale, layer, n),
                                      default=whole)


def _chunked(x: jax.Array, qweight: jax.Array, scale: jax.Array, layer: jax.Array | None,
             n: int) -> jax.Array:
    """XLA's dequantize-then-dot over `n` chunks of output rows (CHUNK_ABOVE)."""
    out, n_in = qweight.shape[-2:]
    if qweight.ndim == 3:
        qweight = jax.lax.dynamic_index_in_dim(qweight, layer, keepdims=False)
        scale = jax.lax.dynamic_index_in_dim(scale, layer, keepdims=False)
    contract = (((x.ndim - 1,), (1,)), ((), ()))
    chunks = (qweight.reshape(n, out // n, n_in), scale.astype(x.dtype).reshape(n, out // n, scale.shape[-1]))
    _, ys = jax.lax.scan(
        lambda c, qs: (c, jax.lax.dot_general(x, dequantize_int8(*qs), contract)), None, chunks)
    return jnp.moveaxis(ys, 0, -2).reshape(*x.shape[:-1], out)  # [n, ..., out/n] -> [..., out]


def num_groups(n_in: int, group_size: int | None = GROUP_SIZE) -> int:
    """Scales per output channel of an `n_in`-input matrix (`group_size` None: one)."""
    return n_in // group_size if group_size and n_in % group_size == 0 else 1


class Dense(nn.Dense):
    """`nn.Dense` that takes (and ignores) the layer index `Int8Dense` needs in the scan."""

    def __call__(self, inputs: jax.Array, layer: jax.Array | None = None) -> jax.Array:
        return super().__call__(inputs)


def _layer_weight(mod: nn.Module, name: str, init: Any, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """A quantized projection's leaf: a param, or inside the layer scan (`mod.num_layers` set)
    the whole [num_layers, *shape] stack in INT8_LAYERS. `init(shape, dtype)`: jnp.zeros/ones."""
    if mod.num_layers is None:
        return mod.param(name, lambda _, s, d: init(s, d), shape, dtype)
    return mod.variable(INT8_LAYERS, name, init, (mod.num_layers, *shape), dtype).value


def _add_bias(mod: nn.Module, y: jax.Array) -> jax.Array:
    """y plus the module's float `bias` when it has one (q/k/v biases stay float)."""
    if not mod.use_bias:
        return y
    return y + mod.param("bias", nn.initializers.zeros_init(), (mod.features,), mod.dtype)


class Int8Dense(nn.Module):
    """`nn.Dense` with scaled weights: params `qweight` [out, in] (int8, or a checkpoint's
    int4 / float8 `values_dtype`), `scale` [out, groups] of `group_size` inputs, `bias`;
    with `zero_points` also `zero_scale` [out, groups] in `dtype`, each group's zero point
    times its scale: w = qweight * scale - zero_scale. With `act_order` also `perm` int32 [in]:
    the inputs in their groups' order (GPTQ's desc_act), columns of `qweight` stored so; the
    product reads x[..., perm].

    Inside the layer scan (`num_layers` set) `qweight` / `scale` are the whole stack
    [num_layers, ...] in the INT8_LAYERS collection and `layer` picks this layer's.
    `cpu_kernel=False` keeps XLA's matmul (tensor parallel: the kernel has no sharding rule).
    """

    features: int
    use_bias: bool = False
    dtype: Any = jnp.float32
    num_layers: int | None = None
    cpu_kernel: bool = True
    values_dtype: str = "int8"
    group_size: int | None = GROUP_SIZE
    zero_points: bool = False
    act_order: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, layer: jax.Array | None = None) -> jax.Array:
        n_in = x.shape[-1]
        x = x.astype(self.dtype)
        if self.act_order:
            perm = _layer_weight(self, "perm", lambda s, d: jnp.broadcast_to(jnp.arange(n_in, dtype=d), s),
                                 (n_in,), jnp.int32)
            if perm.ndim == 2:
                perm = jax.lax.dynamic_index_in_dim(perm, layer, keepdims=False)
            x = jnp.take(x, perm, axis=-1, mode="clip")
        groups = (self.features, num_groups(n_in, self.group_size))
        qweight = _layer_weight(self, "qweight", jnp.zeros, (self.features, n_in),
                                jnp.dtype(self.values_dtype))
        scale = _layer_weight(self, "scale", jnp.ones, groups, jnp.float32)
        y = int8_matmul_rows(x, qweight, scale, layer, self.cpu_kernel)
        if self.zero_points:  # x @ ((q - z) s).T = x @ (q s).T - (x summed per group) @ (z s).T
            # A leaf of its own, not zero and scale: read beside the kernel's scale operand, XLA
            # relaid the whole scale stack at every layer (docs/benchmarks.md, "GPTQ and AWQ").
            zs = _layer_weight(self, "zero_scale", jnp.zeros, groups, self.dtype)
            if zs.ndim == 3:
                zs = jax.lax.dynamic_index_in_dim(zs, layer, keepdims=False)
            sums = x.reshape(*x.shape[:-1], groups[1], n_in // groups[1]).sum(-1, dtype=jnp.float32)
            y = (y - jnp.dot(sums, zs.T, preferred_element_type=jnp.float32)).astype(x.dtype)
        return _add_bias(self, y)


class Bf16Dense(nn.Module):
    """`nn.Dense` with bf16 weights: params `qweight` bf16 [out, in], `bias` (in `dtype`).

    Inside the layer scan (`num_layers` set) `qweight` is the whole stack [num_layers, out,
    in] in the INT8_LAYERS collection and `layer` picks this layer's, as `Int8Dense`.
    `cpu_kernel=False` keeps XLA's matmul (tensor parallel: the kernels have no sharding rule).
    `packed`: the weights are `packed` [(num_layers,) S] in oneDNN's layout (`pack_params`).
    """

    features: int
    use_bias: bool = False
    dtype: Any = jnp.float32
    num_layers: int | None = None
    cpu_kernel: bool = True
    packed: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, layer: jax.Array | None = None) -> jax.Array:
        if self.packed:
            size = bf16_kernel.packed_elements(self.features, x.shape[-1])
            weight = _layer_weight(self, "packed", jnp.zeros, (size,), jnp.bfloat16)
            return _add_bias(self, bf16_kernel.bf16_matmul_packed(x.astype(self.dtype), weight,
                                                                  self.features, layer))
        weight = _layer_weight(self, "qweight", jnp.zeros, (self.features, x.shape[-1]), jnp.bfloat16)
        return _add_bias(self, bf16_kernel.bf16_matmul(x.astype(self.dtype), weight, layer,
                                                       backend="auto" if self.cpu_kernel else "reference"))


class Bf16Embed(nn.Module):
    """`nn.Embed` with bf16 rows (`qweight` [vocab, hidden]); `attend` is the tied LM head,
    over a `packed` copy of the rows when `packed` (`pack_params`)."""

    num_embeddings: int
    features: int
    dtype: Any = jnp.float32
    cpu_kernel: bool = True
    packed: bool = False

    def setup(self) -> None:
        self.qweight = self.param(
            "qweight", nn.initializers.zeros_init(), (self.num_embeddings, self.features), jnp.bfloat16)
        if self.packed:
            size = bf16_kernel.packed_elements(self.num_embeddings, self.features)
            self.packed_rows = self.param("packed", nn.initializers.zeros_init(), (size,), jnp.bfloat16)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.qweight, ids, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        if self.packed:
            return bf16_kernel.bf16_matmul_packed(x.astype(self.dtype), self.packed_rows,
                                                  self.num_embeddings)
        return bf16_kernel.bf16_matmul(x.astype(self.dtype), self.qweight,
                                       backend="auto" if self.cpu_kernel else "reference")


class Int8Embed(nn.Module):
    """`nn.Embed` with int8 rows; `attend` is the tied LM head over the same rows."""

    num_embeddings: int
    features: int
    dtype: Any = jnp.float32
    cpu_kernel: bool = True

    def setup(self) -> None:
        self.qweight = self.param(
            "qweight", nn.initializers.zeros_init(), (self.num_embeddings, self.features), jnp.int8)
        self.scale = self.param(
            "scale", nn.initializers.ones, (self.num_embeddings, num_groups(self.features)), jnp.float32)

    def __call__(self, ids: jax.Array) -> jax.Array:
        rows = jnp.take(self.qweight, ids, axis=0)
        return dequantize_int8(rows, jnp.take(self.scale, ids, axis=0).astype(self.dtype))

    def attend(self, x: jax.Array) -> jax.Array:
        return int8_matmul_rows(x.astype(self.dtype), self.qweight, self.scale, None, self.cpu_kernel)


def dense(
    features: int, use_bias: bool, dtype: Any, fmt: WeightFormat, name: str | None = None,
    num_layers: int | None = None, cpu_kernel: bool = True, group_size: int | None = GROUP_SIZE,
    act_order: bool = False,
) -> nn.Module:
    """The projection for a weight format (float: `Dense`); called `(x, layer)`.
    `num_layers`: the module is inside the layer scan of that many layers; `group_size`: a
    scaled format's inputs per scale (ModelOptions.weight_group_size)."""
    if fmt.scaled:
        return Int8Dense(features, use_bias, dtype, num_layers, cpu_kernel, fmt.values_dtype,
                         group_size, fmt.zero_points, act_order, name=name)
    if fmt.bf16:
        return Bf16Dense(features, use_bias, dtype, num_layers, cpu_kernel, fmt.packed, name=name)
    return Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, name=name)


def embed(
    num_embeddings: int, features: int, dtype: Any, fmt: WeightFormat, cpu_kernel: bool = True,
    tied: bool = False,
) -> nn.Module:
    """The token embedding for a weight format (float: `nn.Embed`, also for a checkpoint's own
    format); bf16 packed and `tied`: bf16 rows with a packed copy for the LM head
    (`pack_params`)."""
    if fmt is WeightFormat.INT8:
        return Int8Embed(num_embeddings, features, dtype, cpu_kernel)
    if fmt.bf16:
        return Bf16Embed(num_embeddings, features, dtype, cpu_kernel, fmt.packed and tied)
    return nn.Embed(num_embeddings, features, dtype=dtype, param_dtype=dtype)


def param_bytes(params: Any) -> int:
    """Bytes of every array in a param tree (the weights' memory, reported at start-up)."""
    return int(sum(jax.dtypes.itemsize_bits(a.dtype) * int(np.prod(a.shape)) // 8
                   for a in jax.tree.leaves(params)))  # int4: half a byte
