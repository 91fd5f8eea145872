"""Stand-in (comera) for transformers' tests/generation/test_utils.py, which the
transformers 5.25.0 source distribution does not include: ``test_modeling_common``
imports ``GenerationTesterMixin`` from here (for an ``issubclass`` check).  It adds
no tests; the test classes here do not inherit it and leave
``all_generative_model_classes`` empty (see README.md).  comera's own generate()
tests of converted models are in tests/integrations/test_hf_generate.py."""


class GenerationTesterMixin:
    pass
