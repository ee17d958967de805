"""Megatron-core: the patches (``patches.py``, loaded by the registry) and the replay driver API
for Megatron trainers. Importing this package does not import megatron."""
