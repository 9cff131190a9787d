"""jsctrl: AICI's JavaScript controller, run in QuickJS (see controller.py and glue.js)."""

from tokenwire.protocols.aici.jsctrl.controller import JsController

__all__ = ["JsController"]
