//! Model specs the unit tests of several modules share.

use crate::spec::{AudioTokenizer, Dtype, ExactWeights, ModelKind, ModelSpec, WeightsOrigin};

/// VibeVoice-ASR as the catalog describes it: a Qwen2.5-7B decoder and 1.06 B parameters of
/// convolutional audio tokenizers stored bf16 and held fp32, 17,348,043,714 B in all.
pub fn vibevoice_asr() -> ModelSpec {
    let mut spec = ModelSpec::dense("microsoft/VibeVoice-ASR", 3584, 18_944, 28, 28, 4, 152_064);
    spec.kind = ModelKind::SpeechToText;
    spec.max_position_embeddings = 65_536;
    spec.audio_tokenizer = Some(AudioTokenizer {
        sample_rate_hz: 24_000,
        samples_per_token: 3200,
    });
    spec.exact_weights = Some(ExactWeights {
        bytes: 17_348_043_714,
        origin: WeightsOrigin::Catalog,
    });
    spec.extra_params = 1_058_405_345;
    spec.extra_dtype = Dtype::F32;
    spec
}
