"""shardpar inside the training frameworks people already use.

Each integration is a module of its own that imports its framework (``lightning``: install
``shardpar[lightning]``); ``import shardpar`` never imports any of them.
"""
