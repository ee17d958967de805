"""FSDP backend: Ulysses partitioning patches (verl, skyrl) and the FSDP replay path.
Importing this package does not import verl, skyrl or torch."""
