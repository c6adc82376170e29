"""Hugging Face checkpoints in and out (docs/models.md, "Bring your model"): the state-dict
adapter of each architecture family (`llama`), reading a model directory's safetensors into
a rank's shards (`weights`), and writing a committed checkpoint as a model directory
(`export`). The architecture itself comes from config.json (services/hf_config.py)."""
