"""torch's entry point (pyproject, group ``torch.backends``): register the "ringlet"
torch.distributed backend as torch is imported, so ``dist.init_process_group("ringlet")``
needs no ringlet import. A failure here warns instead of breaking ``import torch``."""


def register() -> None:
    try:
        from . import torch as _backend  # noqa: F401  (registers on import)
    except Exception as exc:  # noqa: BLE001
        import warnings
        warnings.warn(f"ringlet: the torch.distributed backend did not register: {exc!r}")
