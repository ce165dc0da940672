"""The ground floor: parsing (validate), dtypes, devices, data/, progress bars, fake and emulated CUDA, seeded inputs.
May import: nothing else of labutils. Every other part may import it."""
from labutils.core.surface import lazy_surface

SURFACE = {
    "labutils.core.devices": ["default_dtype", "describe_device", "free_memory_bytes", "is_oom", "pick_device",
                              "resolve_device"],
    "labutils.core.dtypes": ["BYTES", "COMPUTE_DTYPES", "TORCH_DTYPES", "dtype_bytes", "dtype_name", "torch_dtype"],
    "labutils.core.paths": ["data_dir"],
    "labutils.core.progress_bar": ["Steps", "progress"],
}
__getattr__, __dir__, __all__ = lazy_surface(__name__, SURFACE)
