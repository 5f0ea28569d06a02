"""A griffe extension for the API pages: a class's instance attributes without a docstring (the
`self.cfg = cfg`, `self.q = param(...)` of an NNX module's __init__) are left out, so each class shows
its signature, parameters and methods rather than every assignment of its constructor. Module-level
names (rules tables, presets, constants) stay, documented or not.
"""

from __future__ import annotations

import griffe


class HideInstanceAttributes(griffe.Extension):
    def on_class_members(self, *, cls: griffe.Class, **kwargs) -> None:
        for name, member in list(cls.members.items()):
            instance = not member.is_alias and member.is_attribute and "instance-attribute" in member.labels
            if instance and not member.docstring:
                cls.del_member(name)
