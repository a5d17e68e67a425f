"""The entropy coding that cachegen and kvtc share (their sections' lanes are one format, spec/cachegen.md §10):
the frozen table codebook and step grid (:mod:`.tables`), lanes of independent ANS streams (:mod:`.lanes`), a
section's typed arrays read in order (:mod:`.sections`), and the Triton lane decoder staged on a device
(:mod:`.device`)."""
