"""`wedgectl top`: a live terminal view of a vLLM deployment and its verdict (Textual)."""

from wedgectl.tui.source import BundleSource, Collector, LiveSource, ServerInfo, find_servers, save_bundle

__all__ = ["BundleSource", "Collector", "LiveSource", "ServerInfo", "find_servers", "make_app", "save_bundle"]


def make_app(*args, **kwargs):
    """The Textual app (imported lazily: the headless driver and the bench need no Textual)."""
    from wedgectl.tui.app import make_app as _make_app

    return _make_app(*args, **kwargs)
