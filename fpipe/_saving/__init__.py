"""Saving and loading parameters, optimizer and training state: what the rest of fpipe may use.

fpipe's own formats (``save``, ``load``, ``save_state``, ``load_state``, ``AsyncSaver``) and
Hugging Face checkpoint directories (``save_hf``, ``load_hf``). README.md says what each module
owns.
"""

from ._async import AsyncSaver as AsyncSaver
from ._hf_load import load_hf as load_hf
from ._hf_save import save_hf as save_hf
from ._load import load as load
from ._save import save as save
from ._state import TrainState as TrainState
from ._state import load_state as load_state
from ._state import save_state as save_state

__all__ = [
    "AsyncSaver",
    "TrainState",
    "load",
    "load_hf",
    "load_state",
    "save",
    "save_hf",
    "save_state",
]
