"""The engine deployment's router in this process, found by app name (for its statistics).

Serve sends the router class to each process that routes by value, module globals included, so the registry lives
here rather than beside the class.
"""

ROUTERS: dict = {}


def router_of(app_name: str):
    """The `PrefixAffinityRouter` of ``app_name``'s engine deployment in this process, once a request made it."""
    return ROUTERS.get(app_name)
