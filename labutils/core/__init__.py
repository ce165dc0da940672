"""The ground floor: argument parsing (validate), the dtype table, devices, the data/ folder, progress bars, fake CUDA.
May import: nothing else of labutils. Every other part may import it."""
from labutils.core.devices import default_dtype, describe_device, free_memory_bytes, is_oom, pick_device, resolve_device
from labutils.core.dtypes import BYTES, COMPUTE_DTYPES, TORCH_DTYPES, dtype_bytes, dtype_name, torch_dtype
from labutils.core.paths import data_dir
from labutils.core.progress_bar import Steps, progress
