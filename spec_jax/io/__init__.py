"""Models in and out: model directories (orbax), Hugging Face folders, GGUF
files, the built-in pair, and a loaded model with its tokenizer and stop ids.

Nothing here imports the decode loop; the loop's settings are built from a
`ModelBundle`'s stop ids by the caller.
"""
