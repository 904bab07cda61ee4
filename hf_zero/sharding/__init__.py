"""ZeRO's state machine: parameters grouped into flat buckets (`layout`, `grouping`), each owned
by a `FlatParamGroup` (`flat_group`) with its storage tier (`tiers`), its gather and reduce codecs
(`codecs`) and its gradient intake and store; the `reducer` that launches reductions in order;
AutoTP's weight slicing (`tp`); and stage 3's coordinator and model cutting (`stage3`).
"""
