"""The CacheGen section's coding constants and its frozen codebook file (``codebook-v1.u32``).

``kvcodec.codecs.entropy.tables`` builds the tables from these and the Triton kernels (``kvcodec.kernels``)
size their own from them, so the two cannot drift apart and neither imports the other."""

RADIX = 255  # symbols are integers in [-RADIX, RADIX]
ALPHABET = 2 * RADIX + 1
PRECISION = 24  # bits of probability: frequencies sum to 2**24, as constriction's default coders need
NUM_TABLES = 48
CODEBOOK_FILE = "codebook-v1.u32"
CODEBOOK_SHA256 = "7b2e6cf7998ceea4e20f45f7ccf2e83c588c9037c046d227152d1999a68f0e78"
# Not in the bytes: how finely a decoder's slot -> symbol lookup buckets the 2**PRECISION slots, which the CPU
# builds (tables.slot_buckets) and the GPU kernel indexes.
BUCKET_BITS = 12
