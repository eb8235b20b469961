"""The model's variable collections: where the stored param tree's leaves go for `apply`.

The stored tree `{"params": ...}` (what the loaders build and the shardings describe) keeps
every leaf under "params"; the layer scan wants its scaled weights, and a feed-forward of two
kinds of layers, in collections broadcast whole into the scan. Plain dicts, no JAX.
"""

from __future__ import annotations

from typing import Any

# The layer scan's quantized weights are a collection of their own, broadcast whole into the scan
# (`nn.scan(variable_broadcast=INT8_LAYERS)`) rather than sliced per layer: XLA copies a
# scanned slice before a custom call can read it (the whole layer's weights, every step), and
# the CPU kernel takes the stack and the layer index instead. The stored param tree keeps
# them under "params" like every other leaf; `model_variables` moves them for `apply`.
INT8_LAYERS = "int8_layers"
# With dense layers among the sparse (ArchConfig.moe_layers) each kind's feed-forward weights
# stack over that kind's layers only, so the scan cannot slice them: the whole `layers/mlp`
# moves to this collection, broadcast too, and each layer indexes its kind's stack.
MLP_STACKS = "mlp_stacks"


def _is_quantized_leaf(node: dict[str, Any], key: str) -> bool:
    return ("qweight" in node or "packed" in node) and key in ("qweight", "scale", "zero_scale", "perm", "packed")


def _is_mixed_mlp(mlp: Any) -> bool:
    """Whether a scan's `mlp` holds both a router and a dense MLP (ArchConfig.moe_layers)."""
    return isinstance(mlp, dict) and "gate" in mlp and "gate_proj" in mlp


def model_variables(params: dict[str, Any]) -> dict[str, Any]:
    """The stored tree `{"params": ...}` as the model's variables for `apply`: the layer
    scan's quantized scaled leaves move to the INT8_LAYERS collection, and a feed-forward of
    two kinds of layers to MLP_STACKS (same paths)."""
    layers = params["params"].get("layers")
    if not isinstance(layers, dict):
        return params
    if _is_mixed_mlp(layers.get("mlp")):
        rest = {k: v for k, v in layers.items() if k != "mlp"}
        inner = model_variables({**params, "params": {**params["params"], "layers": rest}})
        return {**inner, MLP_STACKS: {"layers": {"mlp": layers["mlp"]}}}

    def split(node: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        rest: dict[str, Any] = {}
        int8: dict[str, Any] = {}
        for k, v in node.items():
            if isinstance(v, dict):
                r, q = split(v)
                if r:
                    rest[k] = r
                if q:
                    int8[k] = q
            elif _is_quantized_leaf(node, k):
                int8[k] = v
            else:
                rest[k] = v
        return rest, int8

    rest, int8 = split(layers)
    if not int8:
        return params
    return {**params, "params": {**params["params"], "layers": rest}, INT8_LAYERS: {"layers": int8}}


def param_tree(variables: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `model_variables` (e.g. for `model.init`'s output): one "params" tree."""
    if INT8_LAYERS not in variables and MLP_STACKS not in variables:
        return variables

    def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(out.get(k, {}), v) if isinstance(v, dict) else v
        return out

    rest = {k: v for k, v in variables.items() if k not in (INT8_LAYERS, MLP_STACKS)}
    params = variables["params"]
    for moved in (INT8_LAYERS, MLP_STACKS):
        params = merge(params, variables.get(moved, {}))
    return {**rest, "params": params}
