"""Weight loaders: one module per on-disk format.

`hf_folder` reads the safetensors or PyTorch files of a Hugging Face folder; `gguf` reads
llama.cpp's GGUF files (config, tokenizer metadata and quantized tensors). Both yield
tensors under Hugging Face parameter names; `aioserve.models.checkpoint` picks between them.
"""
