"""Where a conversion's model comes from and where outputs go: a Hub id, a local folder, a GGUF file
or an alias (load), safetensors shards read and written tensor by tensor (shards), GGUF dequantized
into the cache (gguf), the cache itself (cache), and atomic, guarded output folders (folders)."""
