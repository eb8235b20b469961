"""The accelerators jaxserve estimates speed and cost for: one table, each figure with its source.

Per chip, dense (no 2:4 sparsity: NVIDIA's datasheets print sparse figures, halved here), as
stored on 2026-12-04. `None` is a figure no source gave: an estimate that needs it is refused
with a message naming this table, never computed from a zero. The preflight's `--roofline`
reads it (jaxserve/roofline.py); `--price CHIP=USD` overrides a price.

Sources (the URL and what the page said; Google's TPU pages show no date):
  [tpu-v5e]  https://docs.cloud.google.com/tpu/docs/v5e: 16 GiB HBM, 819 GBps, 197 TFLOPs bf16,
             393 TOPs int8
  [tpu-v5p]  https://docs.cloud.google.com/tpu/docs/v5p: 95 GB HBM2e, 2765 GB/s, 459 TFLOPS bf16
  [tpu-v6e]  https://docs.cloud.google.com/tpu/docs/v6e: 32 GB, 1638 GBps, 918 TFLOPs bf16,
             1836 TOPs int8
  [tpu7x]    https://docs.cloud.google.com/tpu/docs/tpu7x: the v5p / v6e / TPU7x table: BF16
             459 / 918 / 2307 TFLOPs, FP8 459 / 918 / 4614, HBM 95 / 32 / 192 GiB,
             2765 / 1638 / 7380 GB/s (fp8 at the bf16 rate on v5p and v6e)
  [jax-tpu]  jax/_src/pallas/mosaic/tpu_info.py (jax-ml/jax 04c6362): v5p int8 9.18e14 per chip;
             no fp8 matmul on v5e, no int8 matmul on generation 7
  [h100]     NVIDIA H100 SXM datasheet table (reproduced at
             https://archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html; dense figures in
             https://glennklockwood.com/garden/processors/h100, from the Hopper whitepaper):
             80 GB, 3.35 TB/s, BF16 1,979* / FP8 3,958* / INT8 3,958* (* with sparsity)
  [h200]     NVIDIA H200 SXM: 141 GB HBM3e, 4.8 TB/s, the H100's tensor cores (jax-ml/scaling-book
             gpus.md, 2025-08-18: 9.9e14 bf16, 2.0e15 fp8/int8, dense)
  [b200]     NVIDIA HGX B200 (1,000 W) per-GPU table: 180 GB HBM3e, FP16/BF16 4.5 PF*, FP8 9 PF*,
             INT8 9 POPS* (* sparse; https://glennklockwood.com/garden/processors/B200 gives
             dense 2,250 / 4,500 / 4,500); 8 TB/s (DGX B200: 64 TB/s over 8 GPUs)
  [skypilot] skypilot-org/skypilot-catalog catalogs/v8/gcp/vms.csv (from Google's Cloud Billing
             Catalog), us-central1 on-demand: tpu-v5litepod-1 $1.20, tpu-v6e-1 $2.70,
             tpu-v5p-12288 $25,804.80 (6,144 chips: $4.20 a chip)
  [gcp-a3]   Cyclenerd/google-cloud-pricing-cost-calculator pricing.yml (generated 2025-03-06):
             a3-highgpu-8g (8 x H100 with its host) us-central1 $88.49/h
  [gcp-a3u]  tanod/cloud-gpu-list-prices (Cloud Billing Catalog, 2026-10-13): a3-ultragpu-8g
             (H200) us-central1, $10.4365 per GPU-hour with its share of the host
  [gcp-a4]   [skypilot] B200 GPU line, us-central1: $90.216 for 8 GPUs, without the host VM
No price found for TPU7x (pass --price tpu7x=USD).
"""

from __future__ import annotations

import dataclasses

GiB = 1 << 30
GB = 10**9
T = 10**12


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip's public figures (per chip, dense)."""

    name: str  # the --target generation ("v6e", "tpu7x") or GPU ("h100")
    hbm_bytes: int
    devices_per_chip: int  # JAX devices a chip shows (tpu7x: its two TensorCores)
    hbm_bytes_per_s: float | None
    bf16_flops: float | None
    fp8_flops: float | None  # None: no fp8 matmul units (fp8 values run at the bf16 rate)
    int8_ops: float | None  # None: no int8 matmul units (int8 weights run at the bf16 rate)
    usd_per_hour: float | None  # on-demand, one chip (a GPU with its share of the host)
    source: str  # the tags above

    def peak_flops(self, weights: str) -> float | None:
        """The matmul peak for weights stored as `weights` ("bf16", "fp8", "int8"): the
        chip's units for that width, else its bf16 units (the weights widened first)."""
        low = {"fp8": self.fp8_flops, "int8": self.int8_ops}.get(weights)
        return low if low is not None else self.bf16_flops


CHIPS: dict[str, Chip] = {c.name: c for c in (
    # HBM only: the per-device memory the compile-only v4 topologies are checked against.
    Chip("v4", 32 * GiB, 2, None, None, None, None, None, "no source stored for v4's speed"),
    Chip("v5e", 16 * GiB, 1, 819 * GB, 197 * T, None, 393 * T, 1.20, "[tpu-v5e] [jax-tpu] [skypilot]"),
    Chip("v5p", 95 * GiB, 1, 2765 * GB, 459 * T, None, 918 * T, 4.20, "[tpu-v5p] [tpu7x] [jax-tpu] [skypilot]"),
    Chip("v6e", 32 * GiB, 1, 1638 * GB, 918 * T, None, 1836 * T, 2.70, "[tpu-v6e] [tpu7x] [skypilot]"),
    Chip("tpu7x", 192 * GiB, 2, 7380 * GB, 2307 * T, 4614 * T, None, None, "[tpu7x] [jax-tpu]"),
    Chip("h100", 80 * GB, 1, 3.35 * T, 989 * T, 1979 * T, 1979 * T, 88.49 / 8, "[h100] [gcp-a3]"),
    Chip("h200", 141 * GB, 1, 4.8 * T, 989 * T, 1979 * T, 1979 * T, 10.4365, "[h200] [gcp-a3u]"),
    Chip("b200", 180 * GB, 1, 8 * T, 2250 * T, 4500 * T, 4500 * T, 90.216 / 8, "[b200] [gcp-a4]"),
)}


def chip(name: str) -> Chip:
    """The table's chip for a --target's generation or GPU name (ValueError naming the table)."""
    if name not in CHIPS:
        raise ValueError(f"no chip {name!r} in jaxserve/chips.py's CHIPS table "
                         f"({', '.join(CHIPS)}); add it there with its sources")
    return CHIPS[name]


# JAX's device_kind of each TPU generation (GPUs are named in theirs: "NVIDIA H200").
_TPU_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
              "TPU v6 lite": "v6e", "TPU7x": "tpu7x"}


def chip_for_device(device_kind: str) -> Chip | None:
    """The table's chip a JAX device is ("NVIDIA H200" -> h200), or None."""
    if device_kind in _TPU_KINDS:
        return CHIPS[_TPU_KINDS[device_kind]]
    words = device_kind.lower().split()
    return next((c for name, c in CHIPS.items() if name in words), None)


def parse_prices(values: list[str] | None) -> dict[str, float]:
    """--price CHIP=USD ... (ValueError naming the flag)."""
    out: dict[str, float] = {}
    for v in values or []:
        name, sep, usd = v.partition("=")
        try:
            price = float(usd)
        except ValueError:
            price = -1.0
        if not sep or price <= 0:
            raise ValueError(f"--price {v!r}: expected CHIP=USD per chip-hour, e.g. tpu7x=6.0")
        chip(name)
        out[name] = price
    return out
