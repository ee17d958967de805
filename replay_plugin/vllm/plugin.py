"""``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every process it
starts (API server, engine core, workers), including where ``.pth`` files are not processed."""


def register() -> None:
    """Activate replay-plugin in this vLLM process (idempotent, never raises)."""
    try:
        from .. import activate

        activate()
    except Exception as exc:  # noqa: BLE001 - a plugin must not take vLLM down
        import logging

        logging.getLogger("replay_plugin").warning("replay_plugin: activation from vLLM failed: %r", exc)
