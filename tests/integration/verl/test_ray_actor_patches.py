"""A patched method of a class that Ray makes an actor must run patched in the actor.

Ray 2.x ``ray.remote(cls)`` (``_make_actor`` -> ``_inject_tracing_into_class``) looks each method up
on the class in the driver, keeps it in a closure of the subclass it ships by value, and
cloudpickle turns a wrapt proxy found there into the *original* function (the name does not lead
back to the same object: wrapt makes a new bound proxy per lookup). verl's ``vLLMHttpServer`` and
``AgentLoopWorker`` are such classes. Shown with wrapt's own ``FunctionWrapper`` (the problem) and
with the plugin's ``PluginWrapper`` (pickled by reference, found again on the class), on Ray's own
class preparation and its cloudpickle; no cluster is started.
"""

from __future__ import annotations

import asyncio

import wrapt
from support.upstream import need

from replay_plugin.patcher import PluginWrapper


class Server:
    async def generate(self, x):
        return ("stock", x)

    def config(self, x):
        return ("stock", x)


async def _async_wrapper(wrapped, instance, args, kwargs):
    return ("patched", type(instance).__name__, await wrapped(*args, **kwargs))


def _wrapper(wrapped, instance, args, kwargs):
    return ("patched", type(instance).__name__, wrapped(*args, **kwargs))


def _through_ray(cls, name):
    """The method as the actor runs it: Ray's actor subclass, pickled and loaded again."""
    from ray import cloudpickle
    from ray.actor import _modify_class
    from ray.util.tracing.tracing_helper import _inject_tracing_into_class

    shipped = _modify_class(cls)
    _inject_tracing_into_class(shipped)
    loaded = cloudpickle.loads(cloudpickle.dumps(shipped))
    return getattr(loaded.__new__(loaded), name)


def _call(method, *args):
    result = method(*args)
    return asyncio.run(result) if asyncio.iscoroutine(result) else result


def test_wrapt_patches_of_ray_actor_methods_are_lost_and_plugin_wrappers_are_not():
    need("verl")  # Ray comes with verl
    originals = {name: Server.__dict__[name] for name in ("generate", "config")}
    try:
        Server.generate = wrapt.FunctionWrapper(originals["generate"], _async_wrapper)
        Server.config = wrapt.FunctionWrapper(originals["config"], _wrapper)
        assert _call(Server().generate, 1)[0] == "patched"  # in the driver: patched
        assert _call(_through_ray(Server, "generate"), 1) == ("stock", 1)  # in the actor: lost
        assert _call(_through_ray(Server, "config"), 1) == ("stock", 1)

        for name, wrapper in (("generate", _async_wrapper), ("config", _wrapper)):
            setattr(
                Server,
                name,
                PluginWrapper(originals[name], wrapper, "test", target=(__name__, f"Server.{name}"), method=True),
            )
        assert _call(_through_ray(Server, "generate"), 1) == ("patched", "Server", ("stock", 1))
        assert _call(_through_ray(Server, "config"), 2) == ("patched", "Server", ("stock", 2))
        # looked up on the class, called with the instance first: as the plain function
        assert _call(Server.config, Server(), 3) == ("patched", "Server", ("stock", 3))
        assert _call(Server().config, 4) == ("patched", "Server", ("stock", 4))
    finally:
        for name, original in originals.items():
            setattr(Server, name, original)
