"""Which tiling of a scanned bf16 weight stack each TPU generation's loop wants (issue 45).

A `lax.scan` over stacked bf16 weights [30, 1024, 1024] at 16 rows, compiled (compile-only
topologies, no TPU needed) with the stack placed in each tiling. tpu7x's loop reads bf16 in
(16, 128) tiles: given XLA's default (8, 128) parameter layout it copies the whole stack into
(16, 128) every call (on the SparseCore); v5e and v6e want (8, 128) and copy the other way.
`Layout.AUTO` keeps (8, 128) on tpu7x, so the layout must be chosen explicitly.

    python scripts/tpu_weight_tiling.py      (needs the preflight extra: libtpu)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LAYERS, WIDTH, ROWS = 30, 1024, 16
TILINGS = (((8, 128), (2, 1)), ((16, 128), (2, 1)))


def scanned(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0]


def main() -> None:
    print(f"bf16 stack [{LAYERS}, {WIDTH}, {WIDTH}] ({LAYERS * WIDTH * WIDTH * 2:,} B), {ROWS} rows")
    for name in ("v5e:1x1", "v6e:1x1", "tpu7x:1x1"):
        topo = topologies.get_topology_desc(name, "tpu", chips_per_host_bounds=(1, 1, 1))
        rep = NamedSharding(Mesh(np.array(topo.devices[:1]), ("x",)), PartitionSpec())
        x = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.bfloat16, sharding=rep)
        w = jax.ShapeDtypeStruct((LAYERS, WIDTH, WIDTH), jnp.bfloat16, sharding=rep)
        for tiling in TILINGS:
            fmt = Format(Layout(major_to_minor=(0, 1, 2), tiling=tiling), rep)
            c = jax.jit(scanned, in_shardings=(rep, fmt)).trace(x, w).lower().compile()
            cost = c.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            print(f"{name:10} weights tiled {tiling[0]}: temp {c.memory_analysis().temp_size_in_bytes:>11,} B, "
                  f"bytes accessed {cost.get('bytes accessed', 0):>13,.0f} (the loop body counted once)")


if __name__ == "__main__":
    main()
