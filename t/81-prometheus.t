#!/usr/bin/perl

# The metrics as an ops team uses them, with the real llama-server: the
# exposition passes promtool's checks, Debian's Prometheus server scrapes
# it, and a query through Prometheus' HTTP API shows the sessions' effective
# restores, the prompt tokens served from the cache, the save time.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;
use File::Temp qw(tempfile);

# Debian's prometheus package: "make deps" installs it
for my $bin (qw(prometheus promtool)) {
    -x "/usr/bin/$bin"
        or BAIL_OUT("/usr/bin/$bin is missing: run 'make deps'");
}

my $t = LlamaTest->new(workers => 2);
$t->llama(np => 1, ctx => 8192);

$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    location => 'proxy_read_timeout 300s;',
    slots => 'proxy_read_timeout 300s;',
    extra => 'location = /metrics { llama_session_metrics; }'));

my %conv;

sub turn {
    my ($sid) = @_;
    $conv{$sid} //= [ { role => 'user', content => join ' ', map {
                          "Session $sid keeps note $_." } 1 .. 60 } ];
    my $r = $t->post('/v1/chat/completions',
                     { messages => $conv{$sid}, max_tokens => 2,
                       temperature => 0 },
                     headers => { 'X-Session-Id' => $sid });
    die "$sid: $r->{status} $r->{content}\n" unless $r->{status} == 200;
    push @{ $conv{$sid} },
        { role => 'assistant',
          content => $r->{json}{choices}[0]{message}{content} },
        { role => 'user', content => "More, $sid." };
    return $r;
}

turn('a');
turn('b');
my $r = turn('a');
my $cached = $r->{json}{timings}{cache_n};
ok($cached > 400, "a is restored: $cached tokens cached");

# the exposition, checked by Prometheus' own linter

my $expo = $t->get('/metrics')->{content};
my ($fh, $file) = tempfile(DIR => $t->dir);
print $fh $expo;
close $fh;
my $lint = `/usr/bin/promtool check metrics < $file 2>&1`;
is($?, 0, 'promtool check metrics: no problem') or diag $lint;

# Prometheus scrapes it every second

my $pport = LlamaTest::port();
my $nport = $t->{nginx_port};
open my $cf, '>', $t->dir . '/prometheus.yml' or die;
print $cf <<"EOF3";
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: llama_session
    metrics_path: /metrics
    static_configs:
      - targets: ['127.0.0.1:$nport']
EOF3
close $cf;

$t->spawn('prometheus', $t->dir . '/prometheus.log', '/usr/bin/prometheus',
          '--config.file=' . $t->dir . '/prometheus.yml',
          '--storage.tsdb.path=' . $t->dir . '/tsdb',
          "--web.listen-address=127.0.0.1:$pport");
$t->wait_port($pport, 60, 'prometheus');

sub query {
    my ($q) = @_;
    my $u = "http://127.0.0.1:$pport/api/v1/query?query="
            . join '', map { sprintf '%%%02X', ord } split //, $q;
    my $res = $t->{http}->get($u);
    return undef unless $res->{success};
    my $j = $LlamaTest::JSON->decode($res->{content});
    my $v = $j->{data}{result}[0]{value}[1];
    return $v;
}

my $effective;
ok($t->wait_for(sub {
       $effective = query('nginx_llama_session_restore_effects_total{zone="llama",effect="effective"}');
       defined $effective }, 60),
   'Prometheus scraped the module');
is($effective, 1, 'and its query shows the effective restore');
is(query('sum(nginx_llama_session_requests_total{outcome="restore"})'), 1,
   'one request restored');
ok(query('nginx_llama_session_prompt_tokens_total{source="cache"}') >= $cached,
   'the prompt tokens served from the cache');
is(query('nginx_llama_session_save_seconds_count'), 2,
   'the two saves in the save-time histogram');
ok(defined query('histogram_quantile(0.9, nginx_llama_session_swap_seconds_bucket)'),
   'a quantile of the swap time');
is(query('up{job="llama_session"}'), 1, 'the target is up');

$t->stop;
done_testing;
