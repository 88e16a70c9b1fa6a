"""What a checkpoint file says, read without torch: the errors that name what is wrong with one,
the GGUF format (`gguf_reader`), the tokenizer a GGUF file carries (`gguf_tokenizer`), and the
models shipped as Python packages (`packaged`). The config, the tokenizer loader and the models
all read through here."""
