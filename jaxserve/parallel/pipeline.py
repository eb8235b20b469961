"""Pipeline parallelism: the decoder's layers split into stages on sub-meshes.

    mesh (data=1, stage=pp, model=tp)
      stage 0: devices[:, 0, :]  embed + layers [0, L/pp)          kv cache of those layers
      stage 1: devices[:, 1, :]  layers [L/pp, 2L/pp)               ...
      ...
      stage pp-1:                last layers + final norm + LM head (sampler runs here)

Each stage is its own compiled program on its own devices; the hidden states
move between stages with an asynchronous device_put. Because JAX dispatch is
asynchronous, the engine core keeps up to `pp` steps in flight (microbatches:
each with requests of its own, whose input tokens are all known on the host),
so stage 0 of step N+1 runs while a later stage still works on step N.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.models import ArchConfig, AttentionMetadata, decoder_class
from jaxserve.models.attention import ModelOptions
from jaxserve.models.variables import param_tree
from jaxserve.parallel.sharding import param_shardings, weight_placements

if TYPE_CHECKING:
    from jaxserve.models import DecoderModel


@dataclass
class Stage:
    index: int
    layers: tuple[int, int]  # [start, end) of the checkpoint's layers
    mesh: Mesh
    model: DecoderModel  # configured with this stage's layer count
    params: Any
    is_first: bool
    is_last: bool
    kv_cache: Any = None  # the model's cache: an array, or a Gated DeltaNet hybrid's HybridCache

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


def split_layers(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """Contiguous, as even as possible; earlier stages take the remainder."""
    if pp > num_layers:
        raise ValueError(f"--pipeline-parallel-size {pp} exceeds the model's {num_layers} layers")
    bounds = np.cumsum([0] + [num_layers // pp + (i < num_layers % pp) for i in range(pp)])
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def _slice_leaves(tree: Any, start: int, stop: int) -> Any:
    """Every leaf's entries start:stop along its first axis (the layers')."""
    return jax.tree.map(lambda x: x[start:stop], tree)


def stage_params(params: dict[str, Any], layers: tuple[int, int], first: bool, last: bool,
                 arch: ArchConfig) -> dict[str, Any]:
    """The host params one stage needs (its layer slice; embedding/norm/head where used).
    With dense layers among the sparse (`arch.moe_layers`) each feed-forward stack is sliced
    to the stage's layers of its kind, and a kind the stage has none of is left out."""
    if arch.linear_attention is not None:  # one stage only (engine/resolve.py): every param
        return params
    p, tied = params["params"], arch.tie_word_embeddings
    lo, hi = layers
    mixed = arch.moe_layers is not None
    out: dict[str, Any] = {"layers": {
        k: _slice_leaves(v, lo, hi) for k, v in p["layers"].items()
        if not (mixed and k == "mlp")}}
    if mixed:
        mlp = {}
        for name, w in p["layers"]["mlp"].items():
            covered = arch.stack_layers(name)
            a, b = sum(i < lo for i in covered), sum(i < hi for i in covered)
            if b > a:
                mlp[name] = _slice_leaves(w, a, b)
        out["layers"]["mlp"] = mlp
    if first or (last and tied):
        out["embed_tokens"] = p["embed_tokens"]
    if last:
        out["norm"] = p["norm"]
        if not tied:
            out["lm_head"] = p["lm_head"]
    return {"params": out}


def build_stages(
    arch: ArchConfig, host_params: dict[str, Any], mesh: Mesh, opts: ModelOptions,
) -> list[Stage]:
    """Split, place (with each stage's tensor-parallel shardings) and wrap every stage.

    `host_params` are NumPy arrays, or (one stage only) jax Arrays already sharded.
    """
    pp, tp = mesh.shape["stage"], mesh.shape["model"]
    ranges = split_layers(arch.num_hidden_layers, pp)
    stages = []
    for i, rng in enumerate(ranges):
        sub = Mesh(mesh.devices[:, i : i + 1, :], mesh.axis_names)
        first, last = i == 0, i == pp - 1
        host = stage_params(host_params, rng, first, last, arch)
        cfg = arch.layer_range(*rng)
        model = decoder_class(cfg)(cfg, dataclasses.replace(opts, mesh=sub if tp > 1 else None))
        # Arrays already on the mesh (restored sharded from Orbax) are placed as they are.
        placed = all(isinstance(a, jax.Array) for a in jax.tree.leaves(host))
        placements = weight_placements(host, param_shardings(host, sub, opts.expert_parallel))
        params = host if placed and pp == 1 and not _relaid(placements) else jax.device_put(
            host, placements)
        stages.append(Stage(i, rng, sub, model, params, first, last))
    return stages


def abstract_params(model: DecoderModel) -> Any:
    """The loaders' param tree of `model` (decoder and LM head) as ShapeDtypeStructs."""
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    G = len(model.opts.kv_cache_groups.groups)
    # Parameter shapes do not depend on the mesh or the kernels: initialise the plain model.
    plain = type(model)(model.cfg, dataclasses.replace(
        model.opts, mesh=None, attention_backend="reference", attention_interpret=False))
    kv = plain.kv_cache(4, 16, num_state_slots=2)

    def init_all(module: DecoderModel, ids, pos, cache, md):
        return module.compute_logits(module(ids, pos, cache, md)[0])

    def init(key: jax.Array, ids: jax.Array, pos: jax.Array, cache: Any, *md: jax.Array) -> Any:
        slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs = md
        return plain.init(key, ids, pos, cache, AttentionMetadata(
            slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs), method=init_all)

    # The metadata's arrays: slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs.
    md_shapes = (i32(G, 16), i32(4), i32(G, 4, 8), i32(5), i32(1))
    return param_tree(jax.eval_shape(init, jax.random.key(0), i32(16), i32(16), kv, *md_shapes))


def abstract_stages(
    arch: ArchConfig, mesh: Mesh, opts: ModelOptions,
) -> list[Stage]:
    """`build_stages` without weights: each stage's params as ShapeDtypeStructs carrying their
    shardings, for compiling on devices this process may not drive (preflight, KV sizing)."""
    pp, tp = mesh.shape["stage"], mesh.shape["model"]
    full = abstract_params(decoder_class(arch)(arch, opts))
    stages = []
    for i, rng in enumerate(split_layers(arch.num_hidden_layers, pp)):
        sub = Mesh(mesh.devices[:, i : i + 1, :], mesh.axis_names)
        first, last = i == 0, i == pp - 1
        host = jax.eval_shape(functools.partial(stage_params, layers=rng, first=first, last=last,
                                                arch=arch), full)
        cfg = arch.layer_range(*rng)
        model = decoder_class(cfg)(cfg, dataclasses.replace(opts, mesh=sub if tp > 1 else None))
        params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              host, weight_placements(host, param_shardings(host, sub, opts.expert_parallel)))
        stages.append(Stage(i, rng, sub, model, params, first, last))
    return stages


def random_weights(params: Any, seed: int = 0) -> Any:
    """Random arrays for a tree of sharded ShapeDtypeStructs, made on their devices (vLLM's
    --load-format dummy): normal(0, 0.02) floats; int8 `qweight`s in [-127, 127] with the
    `scale` that gives them the same spread. Meaningless tokens, real shapes and speed."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    quantized = {path[:-1] for path, a in leaves if getattr(path[-1], "key", None) == "qweight"}

    def make():
        keys = jax.random.split(jax.random.key(seed), len(leaves))
        out = []
        for key, (path, a) in zip(keys, leaves):
            if jnp.issubdtype(a.dtype, jnp.integer):
                out.append(jax.random.randint(key, a.shape, -127, 128, jnp.int32).astype(a.dtype))
            elif path[:-1] in quantized:  # an int8 weight's scale
                out.append(jnp.full(a.shape, 0.02 / 127, a.dtype))
            else:
                out.append((0.02 * jax.random.normal(key, a.shape, jnp.float32)).astype(a.dtype))
        return jax.tree.unflatten(treedef, out)

    return jax.jit(make, out_shardings=jax.tree.map(_placement, params))()


def _placement(a: jax.ShapeDtypeStruct) -> Any:
    """Where `a` is placed: its Format when it has a device-local layout, else its sharding."""
    return a.format if a.format.layout is not None else a.sharding


def _relaid(placements: Any) -> bool:
    """Whether any leaf is placed in a device-local layout (sharding.weight_placements)."""
    return any(isinstance(p, Format) for p in jax.tree.leaves(placements))
