"""The engine's front half: runs in the server's process (or the caller's, offline) and never imports torch.

AsyncLLM and its request streams, the output processor, the client of the core's pipe, and the offline LLM.
They reach the core only through the seam: engine/types.py, engine/messages.py, engine/ipc.py, engine/rules.py
and engine/launch.py.
"""
