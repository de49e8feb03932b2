"""Planning: which module gets which parallel style, as pure data that can be printed and tested anywhere.

It runs on the meta device with no process group: no torch.distributed at import or at planning time.
It imports only `autotp.compat`; the runtime executes what it decides and never reads its display text.
"""
