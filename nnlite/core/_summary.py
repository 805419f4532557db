def summary(*a, **k): raise NotImplementedError
class Summary: pass
