"""DeepSpeed and FSDP on CPU: Lightning's strategies with their CUDA-only guards lifted, and atomic saves.

Lightning refuses any accelerator but CUDA for DeepSpeed and FSDP, yet DeepSpeed ships a CPU accelerator
that runs ZeRO 1/2/3 over gloo, and PyTorch's FSDP shards over gloo too. Running them lets CI exercise
the real partitioning, checkpoint layouts and export path on two CPU processes. On CUDA every step is
Lightning's own.

DeepSpeed also writes a checkpoint folder file by file, so a save killed half-way would leave a folder
that looks like a checkpoint; here every save goes to a hidden sibling folder and is renamed into place.
Every folder is checked before DeepSpeed or torch.distributed.checkpoint unpickles it (they would run code), and
loaded with every unpickler restricted to plain data (:func:`~torch_handle.unpickling.unpickling_only_data`).
"""

from torch_handle.strategies.deepspeed import DeepSpeedStrategy, require_deepspeed, use_deepspeed_cpu_accelerator
from torch_handle.strategies.fsdp import FSDPStrategy
from torch_handle.strategies.model_parallel import ModelParallelStrategy

__all__ = [
    "DeepSpeedStrategy",
    "FSDPStrategy",
    "ModelParallelStrategy",
    "require_deepspeed",
    "use_deepspeed_cpu_accelerator",
]
