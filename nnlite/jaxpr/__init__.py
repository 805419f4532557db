"""show_jaxpr, the decompiler: a printer core and the rule tables that register into it."""
