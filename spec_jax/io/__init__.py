"""Models in and out: model directories (orbax), Hugging Face folders, GGUF
files, the built-in pair, and a loaded model with its tokenizer and stop ids.
What is particular to each model family (GPT-2, Llama, Gemma...) is one record
in families.py, which hf.py and gguf.py read.

Nothing here imports the decode loop; the caller builds the loop's settings
from a `ModelBundle`'s stop ids:
`DecodeConfig(eos_id=bundle.stop_ids or None, ...)`.
"""
