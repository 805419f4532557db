"""show_jaxpr, the jaxpr decompiler: the printer core and the rule modules that register
into it."""
