"""What the datasheets promise: one row of vendor peaks per device, matched by name."""
from __future__ import annotations

import re
from dataclasses import dataclass

from labutils.perf.roofline import ridge_point


@dataclass(frozen=True)
class DeviceSpec:
    """One row of vendor numbers. TFLOP/s are dense (no 2:4 sparsity); None where the vendor gives none."""

    name: str
    tflops_16: float | None     # fp16/bf16 tensor-core matmul, fp32 accumulate, dense
    tflops_32: float | None     # plain fp32 (no TF32)
    bandwidth_GBps: float       # memory bandwidth, 1 GB = 1e9 bytes
    memory_GB: float
    source: str
    match: str                  # regex matched against describe_device()'s name, lowercased

    @property
    def bandwidth_Bps(self) -> float:
        return self.bandwidth_GBps * 1e9

    @property
    def flops_16(self) -> float | None:
        return None if self.tflops_16 is None else self.tflops_16 * 1e12

    @property
    def ridge(self) -> float | None:
        """fp16/bf16 ridge point in FLOP/byte, or None when no 16-bit figure is published."""
        return None if self.flops_16 is None else ridge_point(self.flops_16, self.bandwidth_Bps)


# NVIDIA datasheets quote tensor-core figures "with sparsity"; the dense figure is half of it.
SPECS: dict[str, DeviceSpec] = {s.name: s for s in [
    DeviceSpec("A100 80GB SXM", 312, 19.5, 2039, 80,
               "NVIDIA A100 Tensor Core GPU datasheet (FP16 Tensor Core 312 TFLOPS dense; HBM2e 2,039 GB/s)",
               r"a100.*sxm.*80"),
    DeviceSpec("H100 SXM", 989, 67, 3350, 80,
               "NVIDIA H100 Tensor Core GPU datasheet (BF16 Tensor Core 1,979 TFLOPS with sparsity; 3.35 TB/s)",
               r"h100.*(sxm|hbm3)"),
    DeviceSpec("H100 PCIe", 756, 51, 2000, 80,
               "NVIDIA H100 Tensor Core GPU datasheet (BF16 Tensor Core 1,513 TFLOPS with sparsity; 2 TB/s)",
               r"h100.*pcie"),
    DeviceSpec("H200 SXM", 989, 67, 4800, 141,
               "NVIDIA H200 Tensor Core GPU datasheet (BF16 Tensor Core 1,979 TFLOPS with sparsity; 4.8 TB/s)",
               r"h200(?!.*nvl)"),
    DeviceSpec("L4", 121, 30.3, 300, 24,
               "NVIDIA L4 Tensor Core GPU datasheet (FP16 Tensor Core 242 TFLOPS with sparsity; 300 GB/s)",
               r"\bl4\b"),
    DeviceSpec("RTX 4090", 165.2, 82.6, 1008, 24,
               "NVIDIA Ada Lovelace architecture whitepaper, RTX 4090: FP16 Tensor with FP32 accumulate "
               "165.2 TFLOPS dense; 1,008 GB/s GDDR6X",
               r"rtx 4090(?!.*laptop)"),
    DeviceSpec("Apple M1", None, 2.6, 68.25, 16,
               "Apple newsroom, Nov 2020 (GPU 2.6 TFLOPS); LPDDR4X-4266 x 128 bit = 68.25 GB/s",
               r"apple m1$"),
    DeviceSpec("Apple M2", None, None, 100, 24,
               "Apple newsroom, Jun 2022 (100GB/s unified memory bandwidth)", r"apple m2$"),
    DeviceSpec("Apple M1 Max", None, None, 400, 64,
               "Apple newsroom, Oct 2021 (up to 400GB/s)", r"apple m1 max"),
    DeviceSpec("Apple M2 Max", None, None, 400, 96,
               "Apple newsroom, Jan 2023 (400GB/s)", r"apple m2 max"),
    DeviceSpec("Apple M3 Max", None, None, 400, 128,
               "Apple newsroom, Oct 2023 (up to 400GB/s)", r"apple m3 max"),
]}


def match_spec(device_name: str) -> DeviceSpec | None:
    """The SPECS row whose pattern matches a device name (as from describe_device), or None."""
    name = device_name.lower().strip()
    for spec in SPECS.values():
        if re.search(spec.match, name):
            return spec
    return None


__all__ = ['DeviceSpec', 'SPECS', 'match_spec']
