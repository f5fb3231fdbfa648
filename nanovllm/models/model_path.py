"""Map the user's `model` argument to a Hugging Face-style directory the engine can load."""
from pathlib import Path

from nanovllm.models.default_model import default_model_path


def convert_gguf(gguf_path: str) -> str:
    # Imported on use: the gguf package is only needed when a .gguf file is actually loaded.
    from nanovllm.models.gguf_convert import convert_gguf as convert
    return convert(gguf_path)


def resolve_model_path(model: str | None) -> str:
    """Map a user-supplied model argument to a directory the engine can load.

    None -> the embedded default model; a .gguf file, or a folder holding exactly one .gguf and
    no config.json -> its converted (cached) directory; anything else is returned unchanged.
    """
    if model is None:
        return convert_gguf(default_model_path())
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"Model path {model!r} does not exist (expected a model directory or a .gguf file)")
    if path.is_file():
        return convert_gguf(str(path)) if path.suffix.lower() == ".gguf" else model
    if (path / "config.json").exists():
        return model
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ValueError(f"Model directory {model!r} has no config.json and several .gguf files ({names}); "
                         "pass the path of the one to load")
    return convert_gguf(str(ggufs[0])) if ggufs else model
