"""bytebound: a batch-1 decode engine for Ling-3.0-flash (BailingMoeV3) sparse MoE models."""

__version__ = "0.1.0"

import logging as _logging

# A library logs; the application decides where it goes. Without this, Python's last-resort handler would
# print bytebound's warnings a second time beside the messages the CLI already prints.
_logging.getLogger("bytebound").addHandler(_logging.NullHandler())
