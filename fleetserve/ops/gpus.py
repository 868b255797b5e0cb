"""GPU and MIG profile tables for the capacity planner.

Figures are NVIDIA's published ones (MIG user guide, product briefs): memory per profile as its name
gives it (in GB of 10^9 bytes, as NVIDIA names them), compute as sevenths of the GPU's SMs, memory
bandwidth as the profile's share of the eight memory slices, and peak dense BF16 tensor FLOP/s (SXM parts).
``all-balanced`` and the ``all-<profile>`` layouts are the GPU operator's default mig-parted configurations.
The L4 and L40S have no MIG.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9


@dataclass(frozen=True)
class MigProfile:
    """One MIG GPU instance profile."""

    name: str  # e.g. "1g.10gb"
    memory_bytes: int
    # Compute slices out of 7.
    num_compute_slices: int
    # Memory slices out of 8; bandwidth is shared in proportion.
    num_memory_slices: int
    # Most instances of this profile one GPU can hold.
    max_instances: int

    @property
    def compute_share(self) -> float:
        return self.num_compute_slices / 7

    @property
    def memory_share(self) -> float:
        return self.num_memory_slices / 8

    @property
    def resource_name(self) -> str:
        """The extended resource the GPU operator's mixed strategy advertises."""
        return f"nvidia.com/mig-{self.name}"


@dataclass(frozen=True)
class GpuSpec:
    """A GPU model the planner knows."""

    name: str  # the --gpu value
    product: str  # nvidia.com/gpu.product label value (single strategy, whole GPU)
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    # Dense 16-bit tensor FLOP/s (the datasheet's figure without sparsity); a MIG slice gets its compute share.
    peak_flops: float
    profiles: tuple[MigProfile, ...]
    # Valid whole-GPU layouts by GPU-operator config name: profile names, one entry per instance.
    layouts: dict[str, tuple[str, ...]]

    def profile(self, name: str) -> MigProfile:
        for profile in self.profiles:
            if profile.name == name:
                return profile
        raise KeyError(f"{self.name} has no MIG profile {name!r}; it has {[p.name for p in self.profiles]}")

    def mig_product(self, profile: MigProfile) -> str:
        """The nvidia.com/gpu.product label under the single strategy, e.g. NVIDIA-H100-80GB-HBM3-MIG-1g.10gb."""
        return f"{self.product}-MIG-{profile.name}"


# (compute slices, memory slices, max instances) of the six profiles, the same on A100, H100 and H200.
_SHAPES = ((1, 1, 7), (1, 2, 4), (2, 2, 3), (3, 4, 2), (4, 4, 1), (7, 8, 1))


def _spec(name: str, product: str, bandwidth_tb_s: float, tflops: float, sizes_gb: tuple[int, ...]) -> GpuSpec:
    profiles = tuple(MigProfile(f"{compute}g.{size}gb", size * GB, compute, memory, most)
                     for size, (compute, memory, most) in zip(sizes_gb, _SHAPES))
    one, _, two, three, four, seven = (p.name for p in profiles)
    layouts = {
        "all-balanced": (one, one, two, three),
        f"all-{one}": (one,) * 7,
        f"all-{two}": (two,) * 3,
        f"all-{three}": (three,) * 2,
        f"all-{four}": (four,),
        f"all-{seven}": (seven,),
    }
    return GpuSpec(name, product, sizes_gb[-1] * GB, bandwidth_tb_s * 1e12, tflops * 1e12, profiles, layouts)


def _whole(name: str, product: str, memory_gb: int, bandwidth_tb_s: float, tflops: float) -> GpuSpec:
    """A GPU without MIG: replicas take it whole, or share it by fractions (Ray packs them)."""
    return GpuSpec(name, product, memory_gb * GB, bandwidth_tb_s * 1e12, tflops * 1e12, (), {})


GPUS: dict[str, GpuSpec] = {
    "a100-80gb": _spec("a100-80gb", "NVIDIA-A100-SXM4-80GB", 2.039, 312, (10, 20, 20, 40, 40, 80)),
    "h100-80gb": _spec("h100-80gb", "NVIDIA-H100-80GB-HBM3", 3.35, 989, (10, 20, 20, 40, 40, 80)),
    "h200-141gb": _spec("h200-141gb", "NVIDIA-H200", 4.8, 989, (18, 35, 35, 71, 71, 141)),
    "l4-24gb": _whole("l4-24gb", "NVIDIA-L4", 24, 0.3, 121),
    "l40s-48gb": _whole("l40s-48gb", "NVIDIA-L40S", 48, 0.864, 362),
}


def gpu(name: str) -> GpuSpec:
    """The spec for a --gpu value.

    Raises:
        KeyError: naming the GPUs that are known.
    """
    try:
        return GPUS[name]
    except KeyError:
        raise KeyError(f"unknown GPU {name!r}; expected one of {sorted(GPUS)}") from None
