"""Model-free n-gram speculators and suffix decoding for specplug (entry points of group `specplug.speculators`).

ngram-simple   prompt lookup in the sequence's own history          (`simple.NgramSimple`)
ngram-map-k    n-gram -> most frequent m-token continuation          (`map_k.NgramMapK`)
ngram-map-k4v  the same, keeping the k most frequent per key         (`map_k4v.NgramMapK4V`)
ngram-mod      hashed n-gram pool shared by all sequences            (`mod.NgramMod`)
ngram-cache    context + dynamic (persistent) + static corpus caches (`cache.NgramCache`)
suffix         suffix decoding: per-request and global suffix trees  (`suffix.Suffix`)

The `specplug ngram-cache build` command (group `specplug.commands`) lives in `cli`.
"""
__version__ = "0.1.0"
