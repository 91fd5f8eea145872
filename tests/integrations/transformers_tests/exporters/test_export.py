"""Stand-in (comera) for transformers' tests/exporters/test_export.py, which the
transformers 5.25.0 source distribution does not include: ``test_modeling_common``
imports ``ExportTesterMixin`` from here.  It adds no tests (torch.export of the
converted models is not part of this suite; see README.md)."""


class ExportTesterMixin:
    pass
